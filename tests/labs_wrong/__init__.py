"""Plausible wrong answers to the labs and bug hunts, one module per chapter.

Each module's ``WRONG`` lists ``(grade_id, answer, words)``: the check cell with that
nbgrader grade id in ``solutions/labs/NN_name.ipynb`` must reject ``answer`` — on its
visible cases or on its hidden ones — with a message containing every one of ``words``
(tests/test_labs.py runs them, each module's answers in one start of the ranks).
"""
