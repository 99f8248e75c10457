"""Per-op profiling against the machine's measured limits: where the time goes, how far each
kernel is from its roofline, which bottlenecks those are, and the Kiln action for each."""

from kiln.profile.run import profile_model

__all__ = ["profile_model"]
