"""bench attention_rates' case specs (the GPU timing itself runs in the GPU runs): equal and unequal contexts parse
apart, a malformed spec is refused by name, and a spread batch holds the contexts it says, the same every run."""

import pytest

from shardserve.bench.attention_cases import spread_contexts
from shardserve.bench.attention_rates import main, split_specs


def test_specs_split_into_equal_and_spread_contexts():
    assert split_specs("64x1024,128x100-2048,32x4096") == ([(64, 1024), (32, 4096)], [(128, 100, 2048)])
    assert split_specs("") == ([], [])


@pytest.mark.parametrize("spec", ["12xfoo", "64", "64x2048-100", "64x0-10", "x-"])
def test_a_malformed_spec_is_refused_with_its_text(spec):
    with pytest.raises(ValueError, match="BATCHxLOW-HIGH"):
        split_specs(spec)


def test_spread_contexts_cover_the_range_evenly_in_a_fixed_shuffled_order():
    contexts = spread_contexts(192, 100, 2048)
    assert len(contexts) == 192 and min(contexts) == 100 and max(contexts) == 2048
    steps = sorted(b - a for a, b in zip(sorted(contexts), sorted(contexts)[1:]))
    assert steps[-1] - steps[0] <= 1  # evenly spread
    assert contexts == spread_contexts(192, 100, 2048) and contexts != sorted(contexts)  # fixed, not in order
    assert spread_contexts(1, 300, 300) == [300]


@pytest.mark.parametrize("flags, expected", [(["--ragged", "64x1024"], "goes to --shapes"),
                                             (["--shapes", "64x100-1024"], "goes to --ragged"),
                                             (["--mixed", "32x1024,8"], "BATCHxCONTEXT")])
def test_a_spec_for_the_wrong_flag_is_refused_before_any_timing(flags, expected):
    """Raised while parsing, before the copy rate is measured (which would fail first here: no GPU)."""
    with pytest.raises(ValueError, match=expected):
        main(["--shapes", ""] + flags)
