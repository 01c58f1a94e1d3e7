"""Inside the Layer: the course library.

Infrastructure: :mod:`launch` (run a program on N ranks), :mod:`distributed` (set up the
process group inside a program), :mod:`comm` (autograd-aware collectives and traffic
accounting), :mod:`widgets` and :mod:`plots`. The dense twins every chapter compares
with: :mod:`model`. Chapter modules: :mod:`collectives` (00), :mod:`tensor_parallel`
(01–02), :mod:`sequence_parallel` and :mod:`memory` (03), :mod:`context_parallel` (04),
:mod:`moe` (05), :mod:`expert_parallel` (06), :mod:`overlap` (07), :mod:`planner` (08).
"""

__version__ = "0.1.0"
