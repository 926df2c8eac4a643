"""The language-model half shared by families with plain (1-D) RoPE positions (Qwen2-Audio,
LLaVA): each placeholder token expands to its item's embedding rows, positions are ``0..seq-1``
(``rope_delta`` is always 0), and the KV is packed as ``[n_layers, 2, n_kv_heads, seq,
head_dim]`` so decode continues on any instance. A family subclass sets ``model``,
``processor``, ``placeholder_token_id`` and ``kind`` (:meth:`_load` sets the first two), calls
:meth:`_init_lm`, and adds its preprocessor and ``encode_media``. Pure and synchronous, like
:mod:`shared.engines.qwen2_vl`.

Design: docs/guide/models.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engines import cpu_attention
from shared.engines.kv_pack import pack_kv, unpack_kv
from shared.engines.qwen2_vl import DecodeState, PrefillResult, _kind


class PlainLMCompute:
    kind = "image"
    mrope = False  # decode positions are plain cache lengths (shared.engines.batched)

    def _load(self, model_cls, model_dir, device: str, dtype: str, parts: frozenset[str] | None = None) -> None:
        """Sets ``model_dir``, ``processor``, ``model`` (on the placement's device and dtype; only
        ``parts`` of it, see :mod:`shared.models.loading`, when given)."""
        from transformers import AutoProcessor

        from shared.models.loading import ALL_PARTS, checkpoint_dtype, load_parts
        from shared.process.device import resolve_placement

        self.model_dir = Path(model_dir)
        self.placement = resolve_placement(device, dtype, checkpoint_dtype(self.model_dir))
        self.device, self.dtype = self.placement.device, self.placement.dtype
        self.processor = AutoProcessor.from_pretrained(str(self.model_dir))
        self.model = load_parts(model_cls, self.model_dir, self.placement, ALL_PARTS if parts is None else parts)

    def _init_lm(self) -> None:
        text_cfg = self.model.config.text_config
        cpu_attention.install(self.model, text_cfg)  # padded decode steps without K/V copies
        self.hidden_size: int = int(text_cfg.hidden_size)
        self.n_layers: int = int(text_cfg.num_hidden_layers)
        self.n_kv_heads: int = int(text_cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(text_cfg, "head_dim", None)
                                 or text_cfg.hidden_size // text_cfg.num_attention_heads)
        self.max_model_len: int = int(text_cfg.max_position_embeddings)
        self.cache_config = text_cfg  # what DynamicCache is built with for this model
        eos = self.model.generation_config.eos_token_id  # generate() stops on these: mirror them
        eos = text_cfg.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset(int(i) for i in ([eos] if isinstance(eos, int) else list(eos or [])))

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def render_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Chat template → token ids with ONE placeholder per item (unexpanded)."""
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def expand_prompt(self, prompt_ids: list[int], items: list) -> list[int]:
        """Each placeholder → its item's row count of placeholders (ValueError on a mismatch)."""
        found = sum(1 for t in prompt_ids if t == self.placeholder_token_id)
        kinds = [_kind(it) for it in items]
        if found != len(items) or any(k != self.kind for k in kinds):
            raise ValueError(f"prompt has {found} {self.kind} placeholders but items {kinds} given")
        expanded: list[int] = []
        it = iter(items)
        for tok in prompt_ids:
            expanded.extend([tok] * (next(it)[0].shape[0] if tok == self.placeholder_token_id else 1))
        return expanded

    @torch.inference_mode()
    def prefill_inputs(self, prompt_ids: list[int], items: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Embeddings ``[L, hidden]`` with the items merged, position ids ``[1, L]``, rope delta 0."""
        dev = self.device
        input_ids = torch.tensor([self.expand_prompt(prompt_ids, items)], dtype=torch.long, device=dev)
        embeds = self.model.get_input_embeddings()(input_ids)
        if items:
            at = (input_ids == self.placeholder_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(at, torch.cat([it[0].to(dev, embeds.dtype) for it in items]))
        return embeds[0], torch.arange(input_ids.shape[1], device=dev)[None, :], 0

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.cache_config)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], items: list) -> PrefillResult:
        embeds, positions, _ = self.prefill_inputs(prompt_ids, items)
        out = self.model(inputs_embeds=embeds[None], position_ids=positions, past_key_values=self.new_cache(),
                         use_cache=True, logits_to_keep=1)
        return PrefillResult(last_logits=out.logits[0, -1].to("cpu", torch.float32),
                             kv=pack_kv(out.past_key_values), rope_delta=0, prompt_len=embeds.shape[0])

    @torch.inference_mode()
    def start_decode(self, kv_packed: torch.Tensor, rope_delta: int, seq_len: int) -> DecodeState:
        cache = unpack_kv(kv_packed, (self.n_layers, 2, self.n_kv_heads, seq_len, self.head_dim),
                          self.model.config.text_config, device=self.device, dtype=self.dtype)
        return DecodeState(cache=cache, rope_delta=0, seq_len=seq_len)

    @torch.inference_mode()
    def decode_step(self, state: DecodeState, token_id: int) -> torch.Tensor:
        cache_len = state.cache.get_seq_length()
        dev = self.device
        out = self.model(input_ids=torch.tensor([[token_id]], dtype=torch.long, device=dev),
                         position_ids=torch.tensor([[cache_len]], dtype=torch.long, device=dev),
                         past_key_values=state.cache, use_cache=True)
        state.seq_len = cache_len + 1
        return out.logits[0, -1].to("cpu", torch.float32)
