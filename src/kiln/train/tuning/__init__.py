"""`kiln.train.tuning`: the fastest TrainConfig for a model at a FIXED global batch, searched by
an Optuna study on kiln tune's storage and remembered in its strategy library.

    result = tune("kiln.train.examples:byte_lm_small", "kiln.train.examples:stdlib_text_small",
                  base=TrainConfig(), global_batch=32, seconds=900, trials=12,
                  max_memory_mib=2048, output="train.json")
    config = read_config("train.json")

The search: precision (bf16 only where the CPU has bf16 kernels), micro_batch × accumulation
(divisors of the global batch), activation checkpointing, torch.compile, strategy × ranks
(ddp on 2 ranks where the cores allow), threads per rank, loader workers and prefetch. The
first trial is the user's `base`; then the winners of the nearest models on this training
hardware class; then Optuna's TPE.

How a trial is judged:
- it runs in a process of its own (`python -m kiln.train.trial`): `probe_steps` optimizer
  steps with `fit`, from the config's seed, on the same data; samples/s is the steady state
  after WARMUP_STEPS;
- kiln.runtime.process_tree polls the trial's process tree and kills the tree past
  `max_memory_mib`: an out-of-memory verdict by measurement, never by an error string;
- before it runs, a config predicted over PREDICT_MARGIN × the limit by the trials measured
  so far (peak ≈ a + b·micro_batch per precision, checkpointing and ranks) is skipped;
- it must train as well as the base: its mean loss over the last third of the steps at most
  LOSS_TOLERANCE (relative) above the base's, else it is rejected with both figures.
The pick then runs against the base in alternating child runs (≥ CONFIRM_ROUNDS each) and is
adopted only when faster beyond their spread.

By concern: `space` (the knobs, the seeds), `memory_model` (predicted peaks), `probe` (one
trial in its own process, its figures), `search` (the study's trials judged), `confirm` (the
pick against the base), `study` (name, Optuna study, result rows), `library` (warm start,
the record kept), `specs` (how trials reach the user's functions), `job` and `api` (`tune`).
"""

from kiln.train.tuning.api import PROBE_STEPS, TRIALS, at_batch, tune
from kiln.train.tuning.confirm import CONFIRM_ROUNDS
from kiln.train.tuning.library import training_class
from kiln.train.tuning.memory_model import PREDICT_MARGIN, over_limit, predict_peak, predicted_over
from kiln.train.tuning.probe import WARMUP_STEPS
from kiln.train.tuning.search import LOSS_TOLERANCE
from kiln.train.tuning.space import TrainSpace, describe, seeds
from kiln.train.tuning.study import nothing_fit, study_name

__all__ = [
    "CONFIRM_ROUNDS",
    "LOSS_TOLERANCE",
    "PREDICT_MARGIN",
    "PROBE_STEPS",
    "TRIALS",
    "WARMUP_STEPS",
    "TrainSpace",
    "at_batch",
    "describe",
    "nothing_fit",
    "over_limit",
    "predict_peak",
    "predicted_over",
    "seeds",
    "study_name",
    "training_class",
    "tune",
]
