"""kvtier.vllm._versions: the vLLM releases the connector was tested
against, and the one place for what differs between them.  A difference
that matters to exact KV (a scheduler callback's order, a block table's
shape, a field renamed) goes here as a small function the connector calls,
with the release it applies to and why; the connector's other modules stay
release-neutral."""
import os

VLLM_VERSIONS = ("0.32.",)  # the KV connector interface these tests ran against


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
