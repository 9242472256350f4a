"""docs/performance.md's headline tables name, for every figure, a date, a commit and a record under docs/results/
that exists: a figure whose record was renamed or never added fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "docs" / "results"


def _headline_rows():
    """The rows of every table under "## Headline figures", as {column: cell}."""
    text = PAGE.read_text()
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows, header = [], None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(cells[0]) <= set("- "):
            rows.append(dict(zip(header, cells)))
    return rows


def test_every_headline_figure_names_its_date_commit_and_an_existing_record():
    rows = _headline_rows()
    assert len(rows) >= 15, len(rows)
    for row in rows:
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", row["date"]), row
        assert re.fullmatch(r"`[0-9a-f]{7,40}`", row["commit"]), row
        record = next(v for k, v in row.items() if k.startswith("record"))
        names = re.findall(r"`([^`]+)`", record)
        assert names, row
        first = names[0]
        assert (RESULTS / first).exists(), f"{first} (named in docs/performance.md) is not in docs/results/"
        # The other names in the cell are beside the first one.
        for name in names[1:]:
            if "/" not in name and (name.endswith(".json") or name.endswith(".txt")):
                assert (RESULTS / Path(first).parent / name).exists(), name
