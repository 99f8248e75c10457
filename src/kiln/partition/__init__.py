"""Partitioned compiles: one model as several parts, each compiled for its own engine.

`partition="auto"` finds the model's independent branches and its join (graph.py), times each
part on each installed engine with the threads it would get (measure.py), places the parts
where the predicted end-to-end latency is lowest (the parts of a stage run at once; place.py),
compiles and verifies each part through the normal compile path on its piece, and verifies the
whole pipeline against the original on the reference inputs, within the budgets a single-part
compile has (build.py). It then times, interleaved, the original under ONNX Runtime as-is, the
best single-engine build of every installed engine and the partitioned build; the partitioned
one is kept when every round says it beats the best single one, or when its median leads by
KEEP_MARGIN and two rounds in three say it is faster (`beats`, choose.py), and written
(write.py). An explicit placement ("image=openvino,text=ort") compiles that placement (parts
not named run on the config's engine).

A model without independent branches is a chain (chain.py): its segments are built through
Kiln's passes for each engine and timed (a chain's gain is what each engine makes of its
stretch), the engines chosen along the chain with a hand-off wherever they change, and runs of
neighbours on one engine become one part; the rest is as for branches. Pieces are run on the
reference one at a time: an unfused piece's arena holds a long sequence's attention scores.
"""

from kiln.partition.build import PartitionedBuild
from kiln.partition.choose import KEEP_MARGIN, beats, rounds_faster
from kiln.partition.graph import PartCut, find_cuts, pieces
from kiln.partition.place import build_partitioned, compile_partitioned
from kiln.partition.write import save_chosen

__all__ = [
    "KEEP_MARGIN",
    "PartCut",
    "PartitionedBuild",
    "beats",
    "build_partitioned",
    "compile_partitioned",
    "find_cuts",
    "pieces",
    "rounds_faster",
    "save_chosen",
]
