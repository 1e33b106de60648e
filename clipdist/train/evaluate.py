"""Zero-shot classification, image↔text retrieval and the validation loss on an evaluation set — on every rank.

Zero-shot uses the labelled samples (.cls or .json "label") when the set has class names; retrieval uses the
samples with captions, an image matching any of its captions (a .txt may hold several, one per line, as
clip_benchmark's retrieval sets do).

Every rank evaluates (a collective where there is a process group): each encodes its share — shard k on rank
k mod N where there are at least N shards, else sample i on rank i mod N (data/eval_stream.py) — in batches that
never span two shards, the features are gathered onto every rank in set order, and the metrics are computed
from them — each rank ranking its share of the images and captions, chunk by chunk (memory bounded: no
images × captions matrix is made), the rank counts gathered. So no rank waits on another one's encoding, the
work is split N ways, and every rank returns the metrics one process computes (split by shard, the features
are bit for bit one process's; split by sample, they differ only by floating-point batching).

Metrics, as open_clip names them where it has them:
- `zeroshot_top1`, `zeroshot_top5`: each class's prompts averaged into a classifier;
- `i2t_r{1,5,10}`, `t2i_r{1,5,10}`: recall@k; `i2t_mean_rank`, `i2t_median_rank`, `t2i_mean_rank`,
  `t2i_median_rank` (1 = right at the top; open_clip's mean_rank / median_rank);
- `clip_loss`: the CLIP loss (softmax, both directions, the model's logit scale) over consecutive blocks of
  `batch_size` captioned samples in set order (each image with its first caption), weighted by block size —
  open_clip's `clip_val_loss` (its blocks are `--batch-size`; in training ours are `world.batch_per_device`), the
  same at any world size;
- `caption_loss` (CoCa models): the caption cross-entropy of each captioned image with its first caption, a mean
  over the label tokens of the whole set (the training objective's caption term, unweighted).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from clipdist.data.batch import apply, floats_to, stack_rows
from clipdist.data.eval_stream import eval_records, shard_of, split_by_shard
from clipdist.data.faults import SkipCounter
from clipdist.data.sources import EvalSet
from clipdist.distributed.parallel import all_ranks, rank_and_world_size
from clipdist.losses import clip_loss
from clipdist.model.factory import has_caption_decoder
from clipdist.objective import caption_cross_entropy

SIMILARITY_BLOCK = 1 << 24  # similarities held at once while ranking (64 MB of float32)


def fill_template(template: str, classname: str) -> str:
    """ "a photo of a {}." or clip_benchmark's "a photo of a {c}."."""
    return template.format(classname, c=classname)


def recall_at_k(similarity: torch.Tensor, owner: torch.Tensor, ks=(1, 5, 10)) -> tuple[dict, dict]:
    """(image→text, text→image) recall@k for images × captions similarities, caption j belonging to image
    owner[j]: an image is right when any of its captions is among its k best, a caption when its image is among
    the k best."""
    image_rank, caption_rank = image_ranks(similarity, owner), caption_ranks(similarity.T, owner)
    return (
        {k: (image_rank < k).double().mean().item() for k in ks},
        {k: (caption_rank < k).double().mean().item() for k in ks},
    )


def image_ranks(similarity: torch.Tensor, owner: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Image→text ranks of the images `offset`, ... of a block of rows of the images × captions similarities
    (caption j belongs to image owner[j]): the number of other images' captions scoring at least as high as the
    image's best own caption. Ties count against the image (pessimistic), so a caption repeated for other
    images ("a photo of a dog") is never a free hit: a metric must not reward ties."""
    rows = torch.arange(len(owner))
    mine = (owner >= offset) & (owner < offset + len(similarity))
    best_true = torch.full((len(similarity),), float("-inf"), dtype=similarity.dtype)
    best_true.scatter_reduce_(0, owner[mine] - offset, similarity[owner[mine] - offset, rows[mine]], "amax")
    own = owner.unsqueeze(0) == torch.arange(offset, offset + len(similarity)).unsqueeze(1)
    return ((similarity >= best_true.unsqueeze(1)) & ~own).sum(dim=1)


def caption_ranks(scores: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Text→image ranks of a block of captions (rows: captions × images), caption j's image owner[j]: the number
    of other images scoring at least as high as its own (ties pessimistic, as in image_ranks)."""
    return (scores >= scores.gather(1, owner.unsqueeze(1))).sum(dim=1) - 1


def _mine(count: int) -> range:
    """This rank's contiguous share of `count` items."""
    rank, world_size = rank_and_world_size()
    return range(count * rank // world_size, count * (rank + 1) // world_size)


def _ranked(queries: torch.Tensor, keys: torch.Tensor, rank_block) -> torch.Tensor:
    """0-based ranks of every query, each rank ranking its share in blocks of SIMILARITY_BLOCK similarities, the
    shares gathered in order: `rank_block(similarities, first query index)` ranks one block."""
    share = _mine(len(queries))
    step = max(1, SIMILARITY_BLOCK // max(1, len(keys)))
    ranks = [
        rank_block(queries[start : min(start + step, share.stop)] @ keys.T, start)
        for start in range(share.start, share.stop, step)
    ]
    mine = torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)
    return torch.cat(all_ranks(mine))


class _Encoder:
    """Features of images and captions in batches; under FSDP (`lockstep`) every rank runs the same number of
    forwards (each gathers the sharded weights from all ranks), a rank with nothing left encoding a stand-in."""

    def __init__(self, model, tokenizer, device, lockstep: bool):
        self.model, self.tokenizer, self.device, self.lockstep = model, tokenizer, device, lockstep
        self.dtype = model.logit_scale.dtype  # pure_bf16 / pure_fp16: the weights' dtype
        self.captions = has_caption_decoder(model)  # CoCa: the caption loss too

    def caption_terms(self, images: list[torch.Tensor], captions: list[str]) -> torch.Tensor:
        """CoCa: (Σ caption cross-entropy over the label tokens, their number) for these image-caption pairs."""
        pixels = self.on_device(images)
        outputs = self.model(pixels, self.tokenizer(captions or [""] * len(images)).to(self.device))
        total, count = caption_cross_entropy(outputs["logits"], outputs["labels"], self.model.pad_id)
        return torch.tensor([total.item(), count.item()], dtype=torch.float64) * (1 if captions else 0)

    def on_device(self, images: list) -> torch.Tensor | dict:
        """Transformed images (tensors, or NaFlex mappings) as one batch on the device, floats in the weights' dtype."""
        return floats_to(apply(stack_rows(images), lambda tensor: tensor.to(self.device)), self.dtype)

    def images(self, images: list) -> torch.Tensor:
        pixels = self.on_device(images)
        return F.normalize(self.model.encode_image(pixels).float(), dim=-1).cpu()

    def texts(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            if self.lockstep:  # the other ranks' forward gathers the weights: this one must take part
                self.model.encode_text(self.tokenizer([""]).to(self.device))
            return torch.zeros(0)
        return F.normalize(self.model.encode_text(self.tokenizer(texts).to(self.device)).float(), dim=-1).cpu()

    def more(self, mine: bool) -> bool:
        """Whether any rank has another batch (every rank asks, under lockstep); else whether this one has."""
        if not self.lockstep:
            return mine
        flag = torch.tensor([float(mine)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def _encode_nothing(encoder: _Encoder, stand_in) -> None:
    """A lockstep rank's forward when its share is done and another rank's is not: a stand-in image, no text."""
    encoder.images([stand_in])
    encoder.texts([])
    if encoder.captions:
        encoder.caption_terms([stand_in], [])


def _encode_share(
    encoder: _Encoder, evalset: EvalSet, image_transform, skips: SkipCounter, batch_size: int, stand_in
) -> dict:
    """This rank's share of the set, encoded: sample indices, image features, caption features and their owners
    (sample indices), labels; or the error that stopped it (reported on every rank by `_gathered`)."""
    rank, world_size = rank_and_world_size()
    indices, image_features, text_features, owners, labels, error = [], [], [], [], [], None
    caption_terms = torch.zeros(2, dtype=torch.float64)  # CoCa: Σ caption cross-entropy, label tokens
    records = iter(eval_records(evalset.urls, skips, rank=rank, world_size=world_size))
    # Split by shard, a batch never spans two shards: its samples are then the same at any world size, and so
    # are their features, bit for bit (a forward's rounding can depend on what else is in its batch).
    by_shard = split_by_shard(evalset.urls, world_size)
    waiting = None  # a record read past the end of the last batch (the next shard's first)
    while True:
        batch: list = [waiting] if waiting is not None else []
        waiting = None
        try:
            for record in records:
                if batch and by_shard and shard_of(record[0]) != shard_of(batch[0][0]):
                    waiting = record
                    break
                batch.append(record)
                if len(batch) == batch_size:
                    break
            if not encoder.more(bool(batch)):
                break
            if not batch:  # lockstep: another rank still encodes
                _encode_nothing(encoder, stand_in)
                continue
            pixels = [image_transform(image) for _, image, _, _ in batch]
            image_features.append(encoder.images(pixels))
            text_features.append(encoder.texts([caption for _, _, captions, _ in batch for caption in captions]))
            captioned = [(image, captions[0]) for image, (_, _, captions, _) in zip(pixels, batch) if captions]
            if encoder.captions and (captioned or encoder.lockstep):
                caption_terms += encoder.caption_terms(
                    [p for p, _ in captioned] or pixels[:1], [c for _, c in captioned]
                )
        except Exception as failure:  # noqa: BLE001 -- agreed with the other ranks (_gathered), then raised on all
            if encoder.lockstep:
                raise  # the ranks' forwards are out of step: nothing to agree on
            error = f"{type(failure).__name__}: {failure}"
            break
        for index, _, captions, label in batch:
            indices.append(index)
            owners += [index] * len(captions)
            labels.append(label)
    return {
        "indices": torch.tensor(indices, dtype=torch.long),
        "images": _rows(image_features),
        "texts": _rows(text_features),
        "owners": torch.tensor(owners, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "skipped": skips.samples,
        "skipped_shards": skips.shards,
        "skip_count": skips.count,
        "last_reason": skips.last_reason,
        "error": error,
        "caption_terms": caption_terms,
    }


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The non-empty (n, d) parts stacked (torch.zeros(0) where all are empty)."""
    parts = [part for part in parts if part.numel()]
    return torch.cat(parts) if parts else torch.zeros(0)


def _gathered(share: dict, evalset: EvalSet) -> dict:
    """Every rank's share in set order: samples by index; captions by their sample's index (stable: a sample's
    captions are contiguous and in order on its rank), each caption's owner as its sample's position. An error
    on any rank is raised on every rank."""
    shares = all_ranks(share)
    errors = [
        (f"rank {rank}: " if len(shares) > 1 else "") + part["error"]
        for rank, part in enumerate(shares)
        if part["error"]
    ]
    if errors:
        raise ValueError(f"eval set {evalset.name}: {errors[0]}")
    indices = torch.cat([part["indices"] for part in shares])
    if not len(indices):
        reason = next((part["last_reason"] for part in shares if part["last_reason"]), None)
        raise ValueError(
            f"eval set {evalset.name}: no sample could be read from {evalset.urls[:3]} "
            f"({sum(part['skip_count'] for part in shares)} skipped; the last: {reason})"
        )
    order = indices.argsort()
    owners = torch.cat([part["owners"] for part in shares])
    caption_order = owners.argsort(stable=True)
    texts = _rows([part["texts"] for part in shares])
    return {
        "images": _rows([part["images"] for part in shares])[order],
        "labels": torch.cat([part["labels"] for part in shares])[order],
        "texts": texts[caption_order] if texts.numel() else None,
        "owners": torch.searchsorted(indices[order], owners[caption_order]),
        "skipped": sum(part["skipped"] for part in shares),
        "skipped_shards": sum(part["skipped_shards"] for part in shares),
        "caption_terms": sum(part["caption_terms"] for part in shares),
    }


def zero_shot_classifier(encoder: _Encoder, classnames: list[str], templates: list[str]) -> torch.Tensor:
    """(classes, d): each class's prompt embeddings averaged and normalised; each rank encodes its share of the
    classes (under lockstep the same number of forwards), the rows gathered."""
    share = _mine(len(classnames))
    _, world_size = rank_and_world_size()
    most = -(-len(classnames) // world_size)
    rows = []
    for position in range(most if encoder.lockstep else len(share)):
        if position < len(share):
            name = classnames[share.start + position]
            embedding = encoder.texts([fill_template(template, name) for template in templates]).mean(dim=0)
            rows.append(F.normalize(embedding, dim=-1))
        else:
            encoder.texts([])
    mine = torch.stack(rows) if rows else torch.zeros(0)
    return _rows(all_ranks(mine))


def clip_loss_in_blocks(images: torch.Tensor, texts: torch.Tensor, logit_scale: float, block: int) -> float:
    """The CLIP loss (losses.clip_loss) over consecutive blocks of `block` pairs, weighted by block size (open_clip's
    val loss)."""
    total = sum(
        clip_loss(images[start : start + block], texts[start : start + block], logit_scale).item()
        * len(images[start : start + block])
        for start in range(0, len(images), block)
    )
    return total / len(images)


@torch.no_grad()
def _text_metrics(model, found: dict, retrieval_ties: str, loss_block: int, captions: bool) -> dict:
    """Retrieval, the CLIP loss over each captioned image's first caption, and CoCa's caption loss."""
    scale = model.logit_scale.exp().detach().float().cpu() if hasattr(model, "logit_scale") else 1.0
    metrics = retrieval_metrics(
        found["images"], found["texts"], found["owners"], ties=retrieval_ties, logit_scale=scale
    )
    first = torch.ones(len(found["owners"]), dtype=torch.bool)
    first[1:] = found["owners"][1:] != found["owners"][:-1]  # each captioned image's first caption
    metrics["clip_loss"] = clip_loss_in_blocks(
        found["images"][found["owners"][first]], found["texts"][first], model.logit_scale.exp().item(), loss_block
    )
    caption_sum, caption_tokens = found["caption_terms"].tolist()
    if captions and caption_tokens:  # CoCa: each image with its first caption, a token mean
        metrics["caption_loss"] = caption_sum / caption_tokens
    return metrics


@torch.no_grad()  # features kept for the whole set: a graph behind them held every batch's activations (23 GB)
def evaluate(
    model,
    tokenizer,
    evalset: EvalSet,
    image_transform,
    device,
    *,
    max_skips_in_a_row: int,
    batch_size: int = 256,
    loss_block: int | None = None,
    autocast=None,
    lockstep: bool = False,
    retrieval_ties: str = "pessimistic",
) -> dict:
    """Metrics on every usable sample of `evalset` (the module docstring), named by evalset.metric(). A collective
    where a process group has several ranks: every rank calls it and gets the same metrics. Images are encoded
    `batch_size` at a time; `clip_loss` is taken over blocks of `loss_block` (default: batch_size) — training
    passes its per-device batch, as open_clip_train's val loader uses `--batch-size`. `lockstep` (FSDP):
    the ranks' forwards are kept in step. `max_skips_in_a_row` unusable samples with no good one between stop it
    (data.max_skips_in_a_row), with a ValueError on every rank."""
    was_training = model.training
    model.eval()
    encoder = _Encoder(model, tokenizer, device, lockstep)
    stand_in = image_transform(Image.new("RGB", (32, 32)))  # what a rank with nothing left encodes in lockstep
    try:
        with autocast if autocast is not None else torch.autocast(device.type, enabled=False):
            share = _encode_share(
                encoder, evalset, image_transform, SkipCounter(max_skips_in_a_row), batch_size, stand_in
            )
            found = _gathered(share, evalset)
            classifier = None
            if evalset.classnames and bool((found["labels"] >= 0).any()):
                classifier = zero_shot_classifier(encoder, evalset.classnames, evalset.templates)
        metrics = {
            "samples": len(found["labels"]),
            "skipped": found["skipped"],
            "skipped_shards": found["skipped_shards"],
        }
        if found["texts"] is not None:
            metrics.update(_text_metrics(model, found, retrieval_ties, loss_block or batch_size, encoder.captions))
        if classifier is not None:
            metrics.update(zero_shot_metrics(found["images"], found["labels"], classifier, evalset))
    finally:
        model.train(was_training)
    return {evalset.metric(key): value for key, value in metrics.items()}


def retrieval_metrics(
    images: torch.Tensor,
    texts: torch.Tensor,
    owners: torch.Tensor,
    ks=(1, 5, 10),
    ties: str = "pessimistic",
    logit_scale: float | torch.Tensor = 1.0,
) -> dict:
    """recall@k and mean/median rank both ways, over the images that have captions (ranks split over ranks).
    `ties="open_clip"`: open_clip_train's rule instead (data.retrieval_ties), to compare with its runs."""
    if str(ties) == "open_clip":
        return open_clip_retrieval(images, texts, owners, ks, logit_scale)
    keep = torch.unique(owners)
    remap = torch.full((len(images),), -1, dtype=torch.long)
    remap[keep] = torch.arange(len(keep))
    owner, kept = remap[owners], images[keep]
    image_rank = _ranked(kept, texts, lambda block, start: image_ranks(block, owner, start))
    caption_rank = _ranked(texts, kept, lambda block, start: caption_ranks(block, owner[start : start + len(block)]))
    # captions that repeat (class-name prompts) make image→text recall degenerate: ties count against the image
    metrics: dict[str, float] = {
        "distinct_captions": len(torch.unique(torch.round(texts.float() * 1e4), dim=0)),
        "images": len(kept),
    }
    for name, ranks in (("i2t", image_rank), ("t2i", caption_rank)):
        metrics.update({f"{name}_r{k}": (ranks < k).double().mean().item() for k in ks})  # the fraction, as float64
        metrics[f"{name}_mean_rank"] = ranks.double().mean().item() + 1  # exact: float32 would round the sum
        metrics[f"{name}_median_rank"] = int(np.floor(np.median(ranks.numpy()))) + 1  # open_clip's, numpy's median
    return metrics


def open_clip_retrieval(
    images: torch.Tensor, texts: torch.Tensor, owners: torch.Tensor, ks=(1, 5, 10), logit_scale=1.0
) -> dict:
    """open_clip_train's retrieval metrics (`get_clip_metrics`): one caption per image, caption i the image i's; each
    ranking is `torch.argsort(similarities, descending=True)`, so captions repeated for other images tie and the
    sort's order decides — the numbers its runs log, for comparing with them (not a measure of the model where
    captions repeat: a tie counts for or against an image as the sort happens to order it)."""
    if len(owners) != len(images) or not torch.equal(owners, torch.arange(len(images))):
        raise ValueError("data.retrieval_ties=open_clip needs one caption per image (open_clip_train's csv layout)")
    ground_truth = torch.arange(len(texts)).view(-1, 1)
    metrics: dict = {
        "distinct_captions": len(torch.unique(torch.round(texts.float() * 1e4), dim=0)),
        "images": len(images),
    }
    logits = (logit_scale * images @ texts.T).detach().cpu()  # as open_clip_train computes them, to tie alike
    for name, similarity in (("i2t", logits), ("t2i", logits.T)):
        ranks = torch.where(torch.argsort(similarity, descending=True) == ground_truth)[1]
        metrics.update({f"{name}_r{k}": (ranks < k).double().mean().item() for k in ks})
        metrics[f"{name}_mean_rank"] = ranks.double().mean().item() + 1
        metrics[f"{name}_median_rank"] = int(np.floor(np.median(ranks.numpy()))) + 1
    return metrics


def zero_shot_metrics(images: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor, evalset: EvalSet) -> dict:
    labelled = labels >= 0
    if int(labels.max()) >= len(evalset.classnames):
        raise ValueError(
            f"eval set {evalset.name}: label {int(labels.max())} but only {len(evalset.classnames)} class names"
        )
    top = (images[labelled] @ classifier.T).topk(min(5, len(evalset.classnames)), dim=1).indices
    target = labels[labelled].unsqueeze(1)
    return {
        "zeroshot_samples": int(labelled.sum()),
        "zeroshot_top1": (top[:, :1] == target).any(dim=1).double().mean().item(),
        "zeroshot_top5": (top == target).any(dim=1).double().mean().item(),
    }
