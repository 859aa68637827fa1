"""What the tests that drive vLLM's scheduler without a model share
(test_scheduler_driven.py, hybrid_driver.py): requests, the stand-in
sampler, the model runner's output as vLLM's scheduler takes it."""
import hashlib


def tokens(n, seed):
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(n)]


def sampled_token(toks):
    """The stand-in model's next token: a function of the tokens so far."""
    h = hashlib.blake2b(bytes(str(toks), "ascii"), digest_size=2).digest()
    return 3 + int.from_bytes(h, "little") % 1000


def request(rid, prompt, max_tokens, hasher=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    kw = dict(request_id=rid, prompt_token_ids=list(prompt), pooling_params=None,
              sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if hasher is not None:
        kw["block_hasher"] = hasher
    return Request(**kw)


def runner_output(ids, sampled, kv_connector_output):
    """ModelRunnerOutput for the requests ids (sampled: req_id -> tokens),
    in the fields this vLLM release has."""
    from vllm.v1.outputs import ModelRunnerOutput
    kw = dict(req_ids=ids, sampled_token_ids=[sampled.get(i, []) for i in ids], logprobs=None,
              prompt_logprobs_dict={}, pooler_output=[], kv_connector_output=kv_connector_output)
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        kw["req_id_to_index"] = {i: k for k, i in enumerate(ids)}
    return ModelRunnerOutput(**kw)


def settle(scheduler_output, worker_connector):
    """After a step that scheduled nothing (every request waits for its
    load), wait for the connector's loads in flight instead of spinning
    more steps: copies on a loaded machine take longer, and a step budget
    must not become a time limit.  A failed copy raises here (these tests
    expect none)."""
    if getattr(scheduler_output, "total_num_scheduled_tokens", 1):
        return
    for op, _, _ in list(getattr(worker_connector, "_loads", {}).values()):
        op.wait()
