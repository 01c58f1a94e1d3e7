"""Inside the Layer: the course library.

Infrastructure: :mod:`launch` (run a program on N ranks), :mod:`distributed` (set up the
process group inside a program), :mod:`comm` (autograd-aware collectives and traffic
accounting), :mod:`widgets` and :mod:`plots`. Chapter modules: :mod:`collectives`
(chapter 00).
"""

__version__ = "0.1.0"
