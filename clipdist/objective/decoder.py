"""LocCa's captioning decoder (Wan et al. 2024; SigLIP 2 trains its image tower with one from the start).

A small transformer decoder (the model's module `caption_decoder`) cross-attends to the image tower's patch tokens —
the tokens of the contrastive forward itself, taken by a hook on the tower's last norm, so the image is encoded
once — and predicts the caption. Each sample is predicted one of two ways, drawn per sample (seeded by its pixels
and the step, clipdist.data.views, so the same sample is predicted the same way on any world size):

- autoregressively: the decoder reads the caption's tokens 0..L−2 under a causal mask and predicts 1..L−1;
- in parallel (a fraction `parallel` of the samples): it reads L−1 mask tokens, each attending to every other
  position of the caption (not to padding), and predicts all of 1..L−1 at once.

The term is the global token mean of the cross-entropy, as CoCa's caption term (caption.py has the per-rank
share): T = Σ_{tokens t of the global batch, label ≠ pad} CE_t / T_count. The decoder is a training-only part:
checkpoints hold it, exports and evaluation leave it out. Referring-expression and grounded-captioning targets, which
LocCa also trains on, need boxes the data does not have: only captioning is here.

Image towers: open_clip's ViT (the tokens after `ln_post`, the class token dropped) and timm's NaFlexVit (the tokens
after the trunk's last `norm`, its prefix tokens dropped; a batch's padding patches are masked out of the
cross-attention, so a sample's logits do not depend on the padding its batch gave it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer

from clipdist.data.views import draws, key_tensor
from clipdist.errors import ConfigError
from clipdist.model.factory import image_width, text_shape
from clipdist.model.timm_towers import vit_trunk_of
from clipdist.objective.base import OwnModule, TermContext
from clipdist.objective.caption import CaptionTerm
from clipdist.objective.teacher import images_in, put_on, tower
from clipdist.registry.terms import DecoderOptions

PART = "caption_decoder"


class CaptionDecoder(OwnModule):
    """Token and position embeddings, a mask token, pre-norm decoder blocks over the projected patch tokens, and a
    projection to the vocabulary."""

    def __init__(self, patch_width: int, vocab: int, context: int, options: DecoderOptions):
        super().__init__()
        width, self.heads = options.width, options.heads  # as attach resolved them (decoder_shape)
        self.token_embedding = torch.nn.Embedding(vocab, width)
        self.positional_embedding = torch.nn.Parameter(torch.randn(context, width) * 0.01)
        self.mask_token = torch.nn.Parameter(torch.zeros(width))
        self.patches = torch.nn.Linear(patch_width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerDecoderLayer(
                width, options.heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(options.layers)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.logits = torch.nn.Linear(width, vocab)

    fsdp_methods = (*OwnModule.fsdp_methods, "cross_entropy")

    def forward(
        self,
        patches: torch.Tensor,
        text: torch.Tensor,
        parallel: torch.Tensor,
        pad_id: int = 0,
        unseen: torch.Tensor | None = None,
    ):
        """(b, L−1, vocab) logits (the reference's: training takes `cross_entropy`, which never holds them all)."""
        # the projection's sum a new tensor, not a view of a matmul's (FSDP2 warns of a module that returns a view)
        return self.hidden(patches, text, parallel, pad_id, unseen) @ self.logits.weight.T + self.logits.bias

    def cross_entropy(
        self,
        patches: torch.Tensor,
        text: torch.Tensor,
        parallel: torch.Tensor,
        pad_id: int = 0,
        unseen: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ CE over the caption tokens that are not padding, their number), the vocabulary's logits made
        CHUNK_LOGITS at a time and again in backward (LinearCrossEntropy): the extra memory is one chunk's float32
        logits, not the (b, L−1, vocab) tensor (8 GiB at 128 × 64 tokens and 256k words)."""
        labels = text[:, 1:]
        kept = labels != pad_id
        hidden, targets = self.hidden(patches, text, parallel, pad_id, unseen)[kept], labels[kept]
        rows = max(1, CHUNK_LOGITS // self.logits.out_features)
        total = LinearCrossEntropy.apply(hidden, self.logits.weight, self.logits.bias, targets, rows)
        return total, kept.sum()

    def hidden(
        self,
        patches: torch.Tensor,
        text: torch.Tensor,
        parallel: torch.Tensor,
        pad_id: int = 0,
        unseen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, L−1, width) states before the vocabulary's projection; `parallel` (b,) says which rows are predicted at
        once; `unseen` (b, P) marks patches no caption attends to (a NaFlex batch's padding). One call for every row
        (under FSDP every rank then gathers the decoder as often), each row with its own attention mask."""
        rows, length = text.shape[0], text.shape[1] - 1
        tokens = self.token_embedding(text[:, :-1])
        mask_tokens = self.mask_token.to(tokens.dtype).expand_as(tokens)
        x = torch.where(parallel[:, None, None], mask_tokens, tokens) + self.positional_embedding[:length]
        # True: not attended. Autoregressive rows: the later positions (padding comes last: no earlier position sees
        # it); parallel rows: the caption's padding
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1).expand(rows, -1, -1)
        padding = (text[:, 1:] == pad_id)[:, None, :].expand(rows, length, length)
        blocked = torch.where(parallel[:, None, None], padding, causal)
        mask = blocked.repeat_interleave(self.heads, dim=0)  # (b·heads, L−1, L−1), as attention takes it
        memory = self.patches(patches)
        for block in self.blocks:
            x = block(x, memory, tgt_mask=mask, memory_key_padding_mask=unseen)
        return self.norm(x)


CHUNK_LOGITS = 1 << 25  # logits made at once by CaptionDecoder.cross_entropy: 128 MiB in float32


class LinearCrossEntropy(torch.autograd.Function):
    """Σ_i CE(h_i·Wᵀ + b, y_i) over the rows of `hidden`, the logits made `rows` at a time in forward and again in
    backward, where each chunk's softmax − one-hot adds into ∂h, ∂W and ∂b in place: what is alive beyond the
    inputs and the gradients is one chunk's logits, never the (rows, vocab) tensor. In float32 at least."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows: int):
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.rows = rows
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        total = hidden.new_zeros((), dtype=dtype)
        for part, answers in zip(hidden.split(rows), labels.split(rows)):
            logits = torch.addmm(bias, part, weight.T).to(dtype)
            total += F.cross_entropy(logits, answers, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels = ctx.saved_tensors
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        grad_hidden = torch.empty_like(hidden)
        grad_weight, grad_bias = torch.zeros_like(weight, dtype=dtype), torch.zeros_like(bias, dtype=dtype)
        for start in range(0, len(hidden), ctx.rows):
            part, answers = hidden[start : start + ctx.rows], labels[start : start + ctx.rows]
            delta = torch.addmm(bias, part, weight.T).to(dtype).softmax(-1)
            delta[torch.arange(len(answers), device=delta.device), answers] -= 1
            delta *= grad.to(dtype)
            grad_hidden[start : start + ctx.rows] = (delta.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight.addmm_(delta.T, part.to(dtype))
            grad_bias += delta.sum(0)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None, None


def attach(options: DecoderOptions, model: torch.nn.Module) -> bool:
    """The decoder put on the model, and the hook that keeps the forward's patch tokens; False where it is off."""
    if not options.on:
        return False
    norm, prefix, patch_width = _token_source(model)
    vocab, context = getattr(model, "vocab_size", None), getattr(model, "context_length", None)
    if not vocab or not context:
        raise ConfigError("loss.decoder needs the model's vocabulary size and context length (open_clip's CLIP)")
    put_on(model, PART, CaptionDecoder(patch_width, vocab, context, decoder_shape(options, model, patch_width)))
    PatchTokens.watch(model, norm, prefix)
    return True


def decoder_shape(options: DecoderOptions, model: torch.nn.Module, patch_width: int) -> DecoderOptions:
    """`options` with layers, width and heads resolved: each as given, or the text tower's (factory.text_shape)
    with `depth` of its layers — SigLIP 2's decoder, the text encoder's shape with half its layers — or, where the
    text tower is not open_clip's, the image tower's width and 8 heads; `depth` needs the text tower's layers."""
    text = text_shape(model)
    layers = options.layers
    if not layers:
        if text is None:
            raise ConfigError(
                f"loss.decoder.depth={options.depth} takes a fraction of the text tower's layers, and this model's "
                f"text tower ({type(getattr(model, 'text', model)).__name__}) is not open_clip's: give "
                "loss.decoder.layers"
            )
        layers = max(1, round(options.depth * text[0]))
    width = options.width or (text[1] if text else patch_width)
    heads = options.heads or (text[2] if text else 8)
    if width % heads:
        raise ConfigError(f"loss.decoder.heads={heads} does not divide the decoder's width {width}")
    return dataclasses.replace(options, layers=layers, width=width, heads=heads)


def _token_source(model: torch.nn.Module) -> tuple[torch.nn.Module, int, int]:
    """(the image tower's module whose output holds every token, the leading tokens that are not patches, the tokens'
    width)."""
    trunk: Any = vit_trunk_of(tower(model))
    if trunk is not None:
        return trunk.norm, trunk.num_prefix_tokens, image_width(model)  # a timm tower's tokens before its pooling head
    visual = tower(model)
    if not isinstance(visual, VisionTransformer) or visual.attn_pool is not None or visual.final_ln_after_pool:
        raise ConfigError(
            "loss.decoder needs open_clip's ViT image tower whose last norm sees every token (no attention pool, "
            f"no final_ln_after_pool), a timm ViT or a NaFlex tower: this model's is {type(visual).__name__}"
        )
    return visual.ln_post, 1, image_width(model)


class PatchTokens:
    """The patch tokens of the model's own forward: armed by a pre-hook on the model, taken by a hook on the image
    tower's last norm at its first call after (the other terms' tower calls, and the teacher's, come later)."""

    def __init__(self, prefix: int = 1):
        self.armed, self.prefix = False, prefix
        self.tokens: torch.Tensor | None = None

    @classmethod
    def watch(cls, model: torch.nn.Module, norm: torch.nn.Module, prefix: int) -> PatchTokens:
        watcher = cls(prefix)
        model.register_forward_pre_hook(watcher.arm)
        norm.register_forward_hook(watcher.keep)
        model.patch_tokens = watcher  # type: ignore[assignment]
        return watcher

    def arm(self, module, args) -> None:
        self.armed, self.tokens = True, None

    def keep(self, module, args, out: torch.Tensor) -> None:
        if self.armed:  # the class (and register) tokens are not patches
            self.armed, self.tokens = False, out[:, self.prefix :]

    def take(self) -> torch.Tensor:
        tokens, self.tokens = self.tokens, None
        if tokens is None:
            raise RuntimeError("loss.decoder: no patch tokens from the model's forward")
        return tokens


def build(options: DecoderOptions, context: TermContext) -> DecoderTerm | None:
    """loss.decoder's term: None at layers=0."""
    return DecoderTerm(context.model, options, context.seed) if options.on else None


class DecoderTerm(CaptionTerm):
    """CaptionTerm's global token mean over the decoder's logits (its merge, value and chunk_value)."""

    name = "decoder_loss"

    def __init__(self, model: torch.nn.Module, options: DecoderOptions, seed: int = 0):
        super().__init__(getattr(model, "pad_id", 0))
        self.decoder: Any = getattr(model, PART)
        self.patch_tokens: PatchTokens = model.patch_tokens  # type: ignore[assignment]
        self.options, self.seed = options, seed
        blocks = self.decoder.blocks
        width = self.decoder.token_embedding.embedding_dim
        self.shape = f"{len(blocks)} layer(s), width {width}, {self.decoder.heads} heads"

    def modules(self) -> list[OwnModule]:
        return [self.decoder]

    def in_parallel(self, images: torch.Tensor | dict) -> torch.Tensor:
        """Which samples are predicted in parallel: (b,) bool, a draw per sample and step (a NaFlex batch's: keyed by
        its patches, whose padding adds nothing to a key)."""
        pixels, _ = images_in(images)
        return draws(key_tensor(pixels), self.seed, self.step or 0, "par:", 1)[:, 0] < self.options.parallel

    def logits_and_labels(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's (b, L−1, vocab) logits of this forward's captions, and their labels (text[:, 1:])."""
        patches, text, parallel = self.decoder_inputs(inputs)
        return self.decoder(patches, text, parallel, self.pad_id, self.unseen(inputs)), text[:, 1:]

    def decoder_inputs(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the forward's patch tokens, the captions, which rows are predicted in parallel)."""
        return self.patch_tokens.take(), inputs["text"], self.in_parallel(inputs["image"])

    @staticmethod
    def unseen(inputs: dict) -> torch.Tensor | None:
        valid = images_in(inputs["image"])[1]
        return None if valid is None else ~valid

    def take(self, raw, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ CE, token count) of this forward's captions."""
        return self.decoder.cross_entropy(*self.decoder_inputs(inputs), self.pad_id, self.unseen(inputs))

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        """T on one process: the mean cross-entropy over every caption token of the batch that is not padding."""
        logits, labels = self.logits_and_labels(inputs)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.pad_id)
