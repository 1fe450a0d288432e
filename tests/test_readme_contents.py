"""README's "Contents" list: every ``##``/``###`` heading is listed once, in order, and each link
is the anchor GitHub gives that heading. Oracle: GitHub's anchor rule (lower case; characters other
than letters, digits, ``_``, ``-`` and spaces dropped; spaces become ``-``), checked on
hand-computed anchors first."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_anchor_rule_on_hand_computed_headings():
    assert _github_anchor("Pooling (`/pooling`, `LLM.encode`)") == "pooling-pooling-llmencode"
    assert _github_anchor("Profiling (`start_profile` / `stop_profile`)") == \
        "profiling-start_profile--stop_profile"
    assert _github_anchor("Disaggregated prefill (`--kv-transfer-config`)") == \
        "disaggregated-prefill---kv-transfer-config"


def test_the_contents_list_names_every_heading_in_order():
    text = README.read_text()
    contents = text[text.index("## Contents\n"):]
    contents = contents[:contents.index("\n## ", 1)]
    listed = re.findall(r"^ *- \[(.+)\]\(#([^)]+)\)$", contents, re.MULTILINE)
    headings = [h for h in re.findall(r"^#{2,3} (.+)$", text, re.MULTILINE)
                if h not in ("Quick start", "Contents")]
    assert [title for title, _ in listed] == headings
    assert [anchor for _, anchor in listed] == [_github_anchor(h) for h in headings]
    assert len(set(headings)) == len(headings)  # GitHub suffixes repeated anchors with -1
