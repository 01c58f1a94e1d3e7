"""A test-only helper: read one setting's output out of an explorer's precomputed table."""


def lookup(explorer, table: dict, **values):
    """The output ``table`` (from ``explorer.table()``) holds for one setting — what the book's
    page shows for it — found as the page's script finds it: the setting's position in the
    grid (the controls in order, the last varying fastest), then the index of distinct outputs."""
    position = 0
    for name, pairs in explorer.options.items():
        position = position * len(pairs) + [v for _, v in pairs].index(values[name])
    return table["outputs"][table["index"][position]]
