"""Deltas that queued up behind a slow stream go out as one Delta message with everything in order."""

from shardserve.cluster.generation_service import merged_delta_to_proto
from shardserve.cluster.outputs import Logprob, RequestDelta
from shardserve.cluster.sampling_params import SamplingParams


def test_merged_deltas_keep_text_tokens_and_logprobs_in_order():
    params = SamplingParams(max_tokens=8, logprobs=1, prompt_logprobs=0)
    first = RequestDelta("r", text="Hel", token_ids=[5], logprobs=[{5: Logprob(-0.1, 1, "Hel")}],
                         prompt_logprobs=[None, {9: Logprob(-2.0, 3, "x")}])
    second = RequestDelta("r", text="", token_ids=[6], logprobs=[{6: Logprob(-0.2, 2, "l"), 4: Logprob(-0.05, 1)}])
    third = RequestDelta("r", text="lo", token_ids=[7, 8],
                         logprobs=[{7: Logprob(-0.3, 1, "l")}, {8: Logprob(-0.4, 1, "o")}])
    msg = merged_delta_to_proto([first, second, third], params).delta
    assert msg.text == "Hello" and list(msg.token_ids) == [5, 6, 7, 8]
    assert [lp.token_id for lp in msg.logprobs] == [5, 6, 7, 8]
    assert [t.token_id for t in msg.logprobs[1].top_logprobs] == [4]  # its top 1, not the chosen token
    assert [lp.token_id for lp in msg.prompt_logprobs] == [9]  # the first delta's, once
