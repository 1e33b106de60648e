"""Zero-shot classification and image↔text retrieval recall@k on an evaluation set.

Zero-shot uses the labelled samples (.cls or .json "label") when the set has class names;
retrieval uses the samples with captions, an image matching any of its captions (a .txt may
hold several, one per line, as clip_benchmark's retrieval sets do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from clipdist.data.faults import SkipCounter
from clipdist.data.eval_stream import eval_records
from clipdist.data.sources import EvalSet


def fill_template(template: str, classname: str) -> str:
    """"a photo of a {}." or clip_benchmark's "a photo of a {c}."."""
    return template.format(classname, c=classname)


@torch.no_grad()
def zero_shot_classifier(model, tokenizer, classnames, templates, device) -> torch.Tensor:
    """(num_classes, d): each class's text embedding averaged over the prompt templates."""
    weights = []
    for name in classnames:
        tokens = tokenizer([fill_template(template, name) for template in templates]).to(device)
        embedding = F.normalize(model.encode_text(tokens).float(), dim=-1).mean(dim=0)
        weights.append(F.normalize(embedding, dim=-1))
    return torch.stack(weights)


def recall_at_k(similarity: torch.Tensor, owner: torch.Tensor, ks=(1, 5, 10)) -> tuple[dict, dict]:
    """(image→text, text→image) recall@k for images × captions similarities, caption j belonging to
    image owner[j]: an image is right when any of its captions is among its k best, a caption
    when its image is among the k best."""
    truth = owner.unsqueeze(0) == torch.arange(similarity.shape[0]).unsqueeze(1)  # (images, captions)
    best_true = similarity.masked_fill(~truth, float("-inf")).amax(dim=1, keepdim=True)
    image_rank = (similarity > best_true).sum(dim=1)  # captions of other images that beat its best one
    caption_scores = similarity.T
    caption_rank = (caption_scores > caption_scores.gather(1, owner.unsqueeze(1))).sum(dim=1)
    return ({k: (image_rank < k).float().mean().item() for k in ks},
            {k: (caption_rank < k).float().mean().item() for k in ks})


@torch.no_grad()
def evaluate(model, tokenizer, evalset: EvalSet, image_transform, device, *, max_skips_in_a_row: int,
             batch_size: int = 256, autocast=None) -> dict:
    """Metrics on every usable sample of `evalset`, named by evalset.metric(); `max_skips_in_a_row` unusable
    samples with no good one between stop it with a DataError (data.max_skips_in_a_row)."""
    was_training = model.training
    model.eval()
    skips = SkipCounter(max_skips_in_a_row)
    image_features, text_features, owners, labels = [], [], [], []

    def flush(images, captions, owner_of):
        pixels = torch.stack(images).to(device, model.logit_scale.dtype)  # pure_bf16 / pure_fp16: the weights' dtype
        image_features.append(F.normalize(model.encode_image(pixels).float(), dim=-1))
        if captions:
            text_features.append(F.normalize(model.encode_text(tokenizer(captions).to(device)).float(), dim=-1))
            owners.extend(owner_of)

    try:
        with autocast if autocast is not None else torch.autocast(device.type, enabled=False):
            images, captions, owner_of, seen = [], [], [], 0
            for image, sample_captions, label in eval_records(evalset.urls, skips):
                images.append(image_transform(image))
                captions += sample_captions
                owner_of += [seen] * len(sample_captions)
                labels.append(label)
                seen += 1
                if len(images) == batch_size:
                    flush(images, captions, owner_of)
                    images, captions, owner_of = [], [], []
            if images:
                flush(images, captions, owner_of)
            if not labels:
                raise ValueError(f"eval set {evalset.name}: no sample could be read from {evalset.urls[:3]} "
                                 f"({skips.count} skipped; the last: {skips.last_reason})")
            metrics = {"samples": len(labels), "skipped": skips.samples, "skipped_shards": skips.shards}
            all_images = torch.cat(image_features)
            if text_features:
                owner = torch.tensor(owners)
                keep = torch.unique(owner)  # retrieval over the images that have captions
                remap = torch.full((len(labels),), -1, dtype=torch.long)
                remap[keep] = torch.arange(len(keep))
                similarity = all_images[keep] @ torch.cat(text_features).T
                image_to_text, text_to_image = recall_at_k(similarity, remap[owner])
                metrics.update({f"i2t_r{k}": v for k, v in image_to_text.items()})
                metrics.update({f"t2i_r{k}": v for k, v in text_to_image.items()})
            truth = torch.tensor(labels)
            labelled = truth >= 0
            if evalset.classnames and labelled.any():
                if int(truth.max()) >= len(evalset.classnames):
                    raise ValueError(f"eval set {evalset.name}: label {int(truth.max())} but only "
                                     f"{len(evalset.classnames)} class names")
                classifier = zero_shot_classifier(model, tokenizer, evalset.classnames, evalset.templates, device)
                logits = all_images[labelled] @ classifier.T
                top = logits.topk(min(5, len(evalset.classnames)), dim=1).indices.cpu()
                target = truth[labelled].unsqueeze(1)
                metrics["zeroshot_samples"] = int(labelled.sum())
                metrics["zeroshot_top1"] = (top[:, :1] == target).any(dim=1).float().mean().item()
                metrics["zeroshot_top5"] = (top == target).any(dim=1).float().mean().item()
    finally:
        model.train(was_training)
    return {evalset.metric(key): value for key, value in metrics.items()}
