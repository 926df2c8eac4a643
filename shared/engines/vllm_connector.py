"""vLLM's NixlConnector with one change: a consumer loads at most the positions the producer
computed. Loaded by vLLM's engine core (``kv_connector_module_path``), never by mmfleet itself.

Why: decode continues from the first token prefill sampled, so its prompt is the producer's
prompt + that token (+ tokens an earlier attempt already streamed, from the token log). Stock
NixlConnector marks every prompt position but the last as loaded from the producer, but the
producer holds KV only for its own ``remote_num_tokens`` positions: the first token's (and the
resumed tokens') slots would be garbage. Capped here, the consumer loads the producer's
positions and computes the few after them itself (text tokens: no embeddings needed).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector


class FleetNixlConnector(NixlConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params or {}
        held = params.get("remote_num_tokens")
        if count and params.get("do_remote_prefill") and held:
            count = min(count, int(held) - num_computed_tokens)
            if count <= 0:
                return 0, False
        return count, load_async
