"""kvtier.vllm._versions: the vLLM releases the connector was tested
against, and the one place for what differs between them.  A difference
that matters to exact KV (a scheduler callback's order, a block table's
shape, a field renamed) goes here as a small function the connector calls,
with the release it applies to and why; the connector's other modules stay
release-neutral."""
import os

# The releases whose real engines ran tests/vllm (their CPU builds).
#
# 0.31 -> 0.32, what changed under the connector and why none of it
# touches exact KV (read from both releases' sources; every engine test
# passed on both):
#   * KVConnectorBase_V1 gained get_loaded_kv_cache_group_ids (default: the
#     prefix-cacheable groups, which is what kvtier restores) and
#     get_external_cache_hit_sources (a metrics label): 0.31 calls neither,
#     and the connector overrides neither, so both run the same code.
#   * get_block_ids_with_load_errors: 0.32 lets a synchronous reading
#     connector drop the blocks it overwrites from the step's blocks to
#     zero; kvtier drops none (in either load mode), so each release
#     zeroes the same blocks and the load writes over them.
#   * v1/core/kv_cache_utils: the block hash (hash_block_tokens, the
#     NONE_HASH seed from PYTHONHASHSEED) is unchanged -- chunk keys, made
#     from those hashes, are the same on both, so engines of the two
#     releases share a segment; what changed is the hit alignment of hybrid
#     models with partial-hash hits (fine-grained lookups), which the
#     connector's chunk arithmetic does not read.
#
# 0.33 and 0.34 (the CUDA package; no CPU build, so no engine of them runs
# here: tests/vllm/test_scheduler_driven.py drives their own Scheduler and
# their own worker-side driver, ActiveKVConnector, with the connector and a
# stand-in forward pass whose every computed token's K and V is checked):
#   * 0.33 added sleep-mode hooks: supports_sleep_mode (default yes),
#     unregister_kv_caches / restore_kv_caches around a sleep that
#     discards the KV cache's contents.  kvtier answers no: a save of a
#     block whose bytes the sleep replaced would be wrong KV under a good
#     key.  On 0.31 and 0.32, which do not ask, _Settings refuses
#     enable_sleep_mode itself.
#   * 0.34 added kv_cache_access (default IN_PROCESS: kvtier's copies run
#     in the worker's process, on the addresses vLLM keeps), may_load_async
#     (only with --max-num-inflight-kv-loads, a scheduling choice: kvtier
#     keeps the default, so its loads start when a running slot is free, as
#     on 0.32) and supports_lookahead_block_hashes (no: the keys are the
#     request's own block hashes); start_load_kv gets keyword arguments
#     (accepted, not needed).  The block hash is unchanged from 0.31.
VLLM_VERSIONS = ("0.31.", "0.32.", "0.33.", "0.34.")


def check(version):
    """Refuses a vLLM outside VLLM_VERSIONS (ImportError naming the tested
    ones) unless KVTIER_VLLM_ANY_VERSION=1."""
    if not any(version.startswith(v) for v in VLLM_VERSIONS) and \
            os.environ.get("KVTIER_VLLM_ANY_VERSION") != "1":
        raise ImportError(
            "kvtier.vllm was built and tested against vLLM %s; this is vLLM %s.  vLLM's KV "
            "connector interface is experimental and changes between releases: install a "
            "tested vLLM, or set KVTIER_VLLM_ANY_VERSION=1 to try this one at your own risk"
            % (" / ".join(v + "x" for v in VLLM_VERSIONS), version))
