"""Test order for pytest-xdist's `--dist loadfile`: the most expensive files first, so that none starts last.

loadfile hands whole files to the workers in the order of the collection (with `--no-loadscope-reorder`;
otherwise xdist sorts the files by their number of tests). A file that takes minutes and starts last keeps one
worker busy long after the other has finished: the run's wall time is then set by that file, not by the total
over the cores.
"""
from __future__ import annotations


def expensive_first(items: list, files: tuple[str, ...]) -> None:
    """Reorder `items` in place: the tests of `files` first, in that order, then the others in their order
    (sorted() is stable: tests keep their order within a file, and the other files theirs)."""
    rank = {path: i for i, path in enumerate(files)}
    items[:] = sorted(items, key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(files)))
