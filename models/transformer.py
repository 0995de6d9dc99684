"""TransformerWithSharedParams: a tiny seq2seq transformer with a tied embedding/output projection.

It exercises a parameter shared by two submodules of the root instance, buffers of two dtypes
(`vocab_bias` float, `long_buffer` int64), an optional BatchNorm (running-stat buffers) and,
when wrapped, one instance per encoder/decoder layer. Inputs: (6, 2) and (4, 2) token ids.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .model_base import DeviceInit, Wrap, ZooModel, generator, move_before_wrap, seeded_init_


class TransformerWithSharedParams(ZooModel):
    """The transformer of torch's FSDP test models; inputs differ per rank, dropout is 0.

    Args:
        d_vocab: vocabulary size (>= 12).
        d_model: model width (divisible by the 8 attention heads).
        add_bn: put a BatchNorm1d on the target embedding (else Identity).
        wrap_layers: with a `wrap`, wrap each encoder/decoder layer (4 instances + the root).
    """

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        d_vocab: int = 23,
        d_model: int = 16,
        add_bn: bool = True,
        wrap_layers: bool = True,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group)
        if d_vocab < 12:
            raise ValueError(f"TransformerWithSharedParams needs d_vocab >= 12, got {d_vocab}")
        self.d_vocab = d_vocab
        self.batch_size = 2
        self.embed_tokens = nn.Embedding(d_vocab, d_model)
        with warnings.catch_warnings():
            # the encoder warns that the nested-tensor fast path needs batch_first
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(
                d_model=d_model,
                num_encoder_layers=2,
                num_decoder_layers=2,
                dim_feedforward=8,
                dropout=0.0,
            )
        self.output_proj = nn.Linear(d_model, d_vocab)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", torch.ones(d_model))
        self.register_buffer("long_buffer", torch.zeros(d_model, dtype=torch.long))
        # BatchNorm over the batch dimension of (T, B, d_model): B = 2 "channels"
        self.bn = nn.BatchNorm1d(self.batch_size) if add_bn else nn.Identity()
        seeded_init_(self, seed=0)
        move_before_wrap(self, device_init, device)
        if wrap is not None and wrap_layers:
            for layers in (self.transformer.encoder.layers, self.transformer.decoder.layers):
                for index, layer in enumerate(layers):
                    layers[index] = wrap(layer)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = generator(1 + self.rank)
        src = torch.randint(0, self.d_vocab, (6, self.batch_size), generator=gen)  # (T_src, B)
        tgt = torch.randint(0, self.d_vocab, (4, self.batch_size), generator=gen)  # (T_tgt, B)
        return src.to(device), tgt.to(device)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_tokens(src_ids)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.bn(self.embed_tokens(tgt_ids))
        return self.output_proj(self.transformer(src, tgt))  # (T_tgt, B, d_vocab)

    def get_loss(self, input: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor):
        _, tgt = input
        return nn.functional.cross_entropy(
            output.view(-1, output.size(-1)), tgt.view(-1), reduction="sum"
        )
