"""vLLM's NixlConnector with two changes: a consumer loads at most the positions the producer
computed (:class:`FleetNixlConnector`), and its NIXL agent runs without a progress thread.
Loaded by vLLM's engine core (``kv_connector_module_path``), never by mmfleet itself.

Design: docs/design/vllm-engine.md.
"""

from __future__ import annotations

import functools

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector


def _without_progress_thread(make_config):
    """NIXL's UCX progress thread (on by default, and vLLM keeps the default) spins a whole core per
    agent, idle or not (measured: 100 % of a core for an idle agent, 0 % without it), since nixl's
    wrapper gives it no wait (``shared.transfer.nixl_thread``). The connector drives transfers from
    the engine's step anyway (``get_finished`` polls transfer states and notifications)."""
    @functools.wraps(make_config)
    def config(*args, **kwargs):
        kwargs["enable_prog_thread"] = False
        return make_config(*args, **kwargs)

    config.mmfleet_patched = True
    return config


# the worker builds its agent's config from this module global (vLLM 0.32); patched once per
# engine-core process, before any connector exists
if base_worker.nixl_agent_config is not None and not getattr(base_worker.nixl_agent_config, "mmfleet_patched", False):
    base_worker.nixl_agent_config = _without_progress_thread(base_worker.nixl_agent_config)


class FleetNixlConnector(NixlConnector):
    """Decode continues from the first token prefill sampled, so its prompt is the producer's
    prompt + that token (+ tokens an earlier attempt already streamed). Stock NixlConnector marks
    every prompt position but the last as loaded, but the producer holds KV only for its own
    ``remote_num_tokens`` positions: the slots after them would be garbage. Capped here, the
    consumer loads the producer's positions and computes the few after them itself."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params or {}
        held = params.get("remote_num_tokens")
        if count and params.get("do_remote_prefill") and held:
            count = min(count, int(held) - num_computed_tokens)
            if count <= 0:
                return 0, False
        return count, load_async
