"""The PDF report's pagination (Qt's text layout): a heading is kept on the page of what it
introduces. Qt's `QTextDocument` has page-break-before but no keep-with-next (CSS
``break-after: avoid``), so `keep_with_next` adds a page break before a heading that would end
a page without its content.

What a heading introduces: its first piece of content (a table's first row, a figure) together
with the few lines of text before it (the section's opening paragraph, a figure's own heading),
or, for a section of text alone, its first lines. A heading that did not fit then starts the
next page with its section; the page it leaves ends early, as in print.
"""

from __future__ import annotations

from typing import Any

#: text blocks between a heading and its content kept on the heading's page, at most
INTRO_BLOCKS = 3


def _level(block: Any) -> int:
    return int(block.blockFormat().headingLevel())


def _is_content(block: Any) -> bool:
    """A table's cell or a block holding an image (a figure)."""
    from PySide6.QtGui import QTextCursor

    if QTextCursor(block).currentTable() is not None:
        return True
    it = block.begin()
    while not it.atEnd():
        if it.fragment().charFormat().isImageFormat():
            return True
        it += 1
    return False


def _first_line(layout: Any, block: Any) -> tuple[float, float]:
    """The top (in the document) and height of a block's first line."""
    rect = layout.blockBoundingRect(block)
    lines = block.layout()
    if not lines.lineCount():
        return rect.top(), rect.height()
    line = lines.lineAt(0)
    return rect.top() + line.y(), line.height()


def _introduced(block: Any) -> Any | None:
    """The block whose first line must share the heading ``block``'s page: the first content
    block after it (past headings of lower rank and up to `INTRO_BLOCKS` text blocks), else the
    last text block before the next heading of its rank or higher, else None."""
    level, text, last = _level(block), 0, None
    after = block.next()
    while after.isValid():
        if _level(after):
            if _level(after) <= level:
                return last
        elif _is_content(after):
            return after
        else:
            text += 1
            last = after
            if text >= INTRO_BLOCKS:
                return after
        after = after.next()
    return last


def _heading_runs(doc: Any) -> list[tuple[Any, int, int]]:
    """Each run of headings (a heading and any headings right after it) as (its first block,
    the page it is on, the page where what it introduces starts), in the document's current
    layout."""
    layout, height = doc.documentLayout(), doc.pageSize().height()
    doc.pageCount()  # lays the whole document out
    out = []
    block = doc.begin()
    while block.isValid():
        previous = block.previous()
        if _level(block) and not (previous.isValid() and _level(previous)):
            target = _introduced(block)
            if target is not None:
                # where the first lines are drawn: a line that would cross a page's foot is
                # moved down inside its block, so the block's own top can be a page early
                top = _first_line(layout, block)[0]
                line_top, line_height = _first_line(layout, target)
                bottom = line_top + max(1.0, line_height) - 0.5
                out.append((block, int(top // height), int(bottom // height)))
        block = block.next()
    return out


def heading_pages(doc: Any) -> list[tuple[str, int, int]]:
    """(heading, its page, the page where what it introduces starts) for each run of
    headings."""
    return [(block.text(), page, follows) for block, page, follows in _heading_runs(doc)]


def keep_with_next(doc: Any, rounds: int = 100) -> int:
    """Keep every heading on the page of what it introduces: a heading left at the foot of a
    page (its table or figure pushed on to the next) gets a page break before it, so a large
    figure starts a page with its heading and the section's opening lines. Returns how many
    breaks were added."""
    from PySide6.QtGui import QTextBlockFormat, QTextCursor, QTextFormat

    always = QTextFormat.PageBreakFlag.PageBreak_AlwaysBefore
    added = 0
    for _ in range(rounds):  # each break moves everything after it: look again from the top
        for block, page, follows in _heading_runs(doc):
            if page != follows and not block.blockFormat().pageBreakPolicy() & always:
                fmt = QTextBlockFormat()
                fmt.setPageBreakPolicy(always)
                QTextCursor(block).mergeBlockFormat(fmt)
                start = block.position()  # everything after it moves: lay it out again
                doc.markContentsDirty(start, doc.characterCount() - start)
                added += 1
                break
        else:
            return added
    return added


def page_fill(doc: Any) -> list[float]:
    """How full each page of the laid-out document is: the foot of its last line, as a share
    of the page's height (a page break or a figure that did not fit leaves the rest empty)."""
    layout, height = doc.documentLayout(), doc.pageSize().height()
    fill = [0.0] * doc.pageCount()
    block = doc.begin()
    while block.isValid():
        rect = layout.blockBoundingRect(block)
        lines = block.layout()
        feet = ([rect.top() + lines.lineAt(i).y() + lines.lineAt(i).height()
                 for i in range(lines.lineCount())] or [rect.bottom()])
        for foot in feet:
            page = min(int((foot - 0.5) // height), len(fill) - 1)
            if page >= 0:
                fill[page] = max(fill[page], (foot - page * height) / height)
        block = block.next()
    return fill
