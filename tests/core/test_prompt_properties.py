"""Property tests (hypothesis) of segment tokenization and the reduced sequence: for any text,
the segments concatenate to the full ids, the reduced ids are exactly the full ids without the
absorbed segments, positions are consistent, and nothing crashes on odd Unicode."""

from __future__ import annotations

from ctxpatch.core.errors import UserError
from ctxpatch.core.prompt import build_prompt, check_prompt, reduced_sequence
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import tiny_tokenizer

TOK = tiny_tokenizer()
# any Unicode (combining marks, right-to-left, emoji, NUL), but no surrogates
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
HISTORY = st.lists(st.integers(min_value=3, max_value=TOK.vocab_size - 1), max_size=6)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(context=TEXT, query=TEXT, history=HISTORY)
def test_reduced_context_is_the_full_sequence_without_the_context(context: str, query: str,
                                                                  history: list[int]) -> None:
    prompt = build_prompt(TOK, context, query)
    assert prompt.full_ids == tuple(i for s in prompt.segments for i in s.ids)
    assert all(s.ids for s in prompt.segments)  # no empty segment
    kept = [i for s in prompt.segments if s.kind != "context" for i in s.ids]
    red, positions = reduced_sequence(prompt, history, "context")
    assert red == kept + history and positions is None
    # the context segment is an exact sub-sequence of the full ids, at its place
    start = 0
    for s in prompt.segments:
        assert prompt.full_ids[start:start + len(s.ids)] == s.ids
        start += len(s.ids)
    try:
        check_prompt(prompt, "context")
    except UserError as exc:  # only ever for a missing context, or a missing or blank query
        assert "empty" in str(exc)
        assert not context or not query.strip()
    else:
        assert context and query.strip()


@FAST
@given(context=TEXT, query=TEXT, history=HISTORY, keep_bos=st.booleans())
def test_absorb_all_keeps_the_current_token_at_its_absolute_position(
        context: str, query: str, history: list[int], keep_bos: bool) -> None:
    prompt = build_prompt(TOK, context, query)
    full = list(prompt.full_ids) + history
    if not full:
        return
    red, positions = reduced_sequence(prompt, history, "all", keep_bos)
    assert positions is not None and red[-1] == full[-1] and positions[-1] == len(full) - 1
    if len(red) == 2:  # BOS kept at position 0
        assert keep_bos and red[0] == TOK.bos_token_id == full[0] and positions[0] == 0
    else:
        assert red == [full[-1]]
