"""Zero-shot classification and image↔text retrieval recall@k on validation shards."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from clipdist.data.pipeline import SkipCounter, eval_batches


@torch.no_grad()
def zero_shot_classifier(model, tokenizer, classnames, templates, device) -> torch.Tensor:
    """(num_classes, d): each class's text embedding averaged over the prompt templates."""
    weights = []
    for name in classnames:
        tokens = tokenizer([template.format(name) for template in templates]).to(device)
        embedding = F.normalize(model.encode_text(tokens).float(), dim=-1).mean(dim=0)
        weights.append(F.normalize(embedding, dim=-1))
    return torch.stack(weights)


def recall_at_k(similarity: torch.Tensor, ks=(1, 5, 10)) -> dict[int, float]:
    """Fraction of rows whose own column (the diagonal) is among the k largest entries."""
    target = similarity.diagonal().unsqueeze(1)
    rank = (similarity > target).sum(dim=1)  # how many candidates beat the true match
    return {k: (rank < k).float().mean().item() for k in ks}


@torch.no_grad()
def evaluate(model, tokenizer, val_urls, image_transform, classnames, templates, device,
             batch_size: int = 256, autocast=None) -> dict:
    """Metrics on every validation sample: zero-shot top-1/top-5 (if classes and labels) and recall@1/5/10."""
    was_training = model.training
    model.eval()
    skips = SkipCounter()
    image_features, text_features, labels = [], [], []
    with autocast if autocast is not None else torch.autocast(device.type, enabled=False):
        for images, captions, metas in eval_batches(val_urls, batch_size, image_transform, skips):
            image_features.append(F.normalize(model.encode_image(images.to(device)).float(), dim=-1))
            text_features.append(F.normalize(model.encode_text(tokenizer(captions).to(device)).float(), dim=-1))
            labels.extend(meta.get("label", -1) for meta in metas)
        if not image_features:
            raise ValueError(f"no validation samples could be read from {val_urls[:3]}")
        images_emb, texts_emb = torch.cat(image_features), torch.cat(text_features)
        similarity = images_emb @ texts_emb.T
        metrics = {"val_samples": len(labels), "val_skipped": skips.count}
        for k, value in recall_at_k(similarity).items():
            metrics[f"i2t_r{k}"] = value
        for k, value in recall_at_k(similarity.T).items():
            metrics[f"t2i_r{k}"] = value
        if classnames and all(label >= 0 for label in labels):
            classifier = zero_shot_classifier(model, tokenizer, classnames, templates, device)
            top = (images_emb @ classifier.T).topk(min(5, len(classnames)), dim=1).indices.cpu()
            truth = torch.tensor(labels).unsqueeze(1)
            metrics["zeroshot_top1"] = (top[:, :1] == truth).any(dim=1).float().mean().item()
            metrics["zeroshot_top5"] = (top == truth).any(dim=1).float().mean().item()
    model.train(was_training)
    return metrics
