"""What the fuzz tests of saved files share: every place in a JSON value, and any JSON value."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

#: a value a fuzz test puts in a place to delete it
DELETE = object()

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=3),
    max_leaves=6)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``node`` (the keys and indices leading to it), the root first."""
    out = [prefix]
    children = (node.items() if isinstance(node, dict) else
                enumerate(node) if isinstance(node, list) else ())
    for key, child in children:
        out += paths(child, (*prefix, key))
    return out
