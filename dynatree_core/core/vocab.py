"""Reduced-vocabulary drafts: a draft that predicts only the N most useful target tokens.

A full-vocabulary LM head dominates the cost of a small draft (49k x hidden multiply-adds per
token) and its training. A reduced draft is a stock causal LM whose vocabulary is N slots:
slot 0 (OTHER) stands for every target token outside the set, slots 1..N-1 for chosen target
tokens. `token_map.json` beside the weights holds `draft_to_target` (N ids, -1 for OTHER).
The engine maps the draft's inputs target->draft (unknown tokens read as OTHER) and its
log-probabilities draft->target (OTHER is never proposed). Greedy exactness is unaffected:
verification only ever looks at the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKEN_MAP_FILE = "token_map.json"
OTHER = 0


class TokenMap:
    def __init__(self, draft_to_target: list[int], target_vocab: int):
        if draft_to_target[OTHER] != -1:
            raise ValueError("slot 0 of a token map must be OTHER (-1)")
        self.draft_to_target = torch.tensor(draft_to_target, dtype=torch.long)
        self.target_vocab = target_vocab
        self.target_to_draft = torch.full((target_vocab,), OTHER, dtype=torch.long)
        self.target_to_draft[self.draft_to_target[1:]] = torch.arange(1, len(draft_to_target))

    def __len__(self) -> int:
        return len(self.draft_to_target)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(target_to_draft, draft_to_target[1:]) on `device`, copied there once, not per draft level."""
        cache = self.__dict__.setdefault("_devices", {})
        key = str(device)
        if key not in cache:
            cache[key] = (self.target_to_draft.to(device), self.draft_to_target[1:].to(device))
        return cache[key]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self._on(target_ids.device)[0][target_ids]

    def to_target_logp(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(q, N) draft logits -> (q, target_vocab) log-probs; OTHER and unmapped ids get -inf."""
        logp = self._logp(draft_logits)
        full = torch.full((logp.shape[0], self.target_vocab), -torch.inf, device=logp.device)
        full[:, self._on(logp.device)[1]] = logp
        return full

    def top_target(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` most probable proposable tokens of each row: float32 log-probs (to_target_logp's
        values) and target ids, from the draft's slots; only the k ids are mapped."""
        lp, slots = self._logp(draft_logits).topk(min(k, len(self.draft_to_target) - 1), dim=-1)
        return lp.float(), self._on(lp.device)[1][slots]

    @staticmethod
    def _logp(draft_logits: torch.Tensor) -> torch.Tensor:
        """Log-probs over the slots after OTHER (never proposed), slot i + 1 in column i."""
        return torch.log_softmax(draft_logits[:, OTHER + 1 :], dim=-1)

    def full_vocab_model(self, draft: torch.nn.Module) -> torch.nn.Module:
        """A copy of the draft that reads and predicts target ids directly (for tools that expect
        the target's vocabulary, such as HF assisted generation): embedding rows gathered per
        target id (unknown ids read OTHER), an untied LM head whose rows are gathered the same way
        with a large negative bias on ids the draft cannot propose. Cached per draft."""
        import copy

        cache = self.__dict__.setdefault("_full_models", {})
        if id(draft) in cache:
            return cache[id(draft)]
        full = copy.deepcopy(draft)
        index = self.target_to_draft
        emb = draft.get_input_embeddings().weight.detach()
        head = draft.get_output_embeddings().weight.detach()
        new_emb = torch.nn.Embedding(self.target_vocab, emb.shape[1], dtype=emb.dtype)
        new_emb.weight.data.copy_(emb[index])
        new_head = torch.nn.Linear(head.shape[1], self.target_vocab, bias=True, dtype=head.dtype)
        new_head.weight.data.copy_(head[index])
        new_head.bias.data.fill_(0.0)
        new_head.bias.data[index == OTHER] = torch.finfo(head.dtype).min / 2
        full.config.tie_word_embeddings = False
        full.config.vocab_size = self.target_vocab
        full.set_input_embeddings(new_emb.to(emb.device))
        full.set_output_embeddings(new_head.to(head.device))
        cache[id(draft)] = full.eval()
        return cache[id(draft)]

    def save(self, directory: Path) -> None:
        data = {"draft_to_target": self.draft_to_target.tolist(), "target_vocab": self.target_vocab}
        (Path(directory) / TOKEN_MAP_FILE).write_text(json.dumps(data))

    @classmethod
    def load(cls, directory: Path) -> TokenMap | None:
        path = Path(directory) / TOKEN_MAP_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(data["draft_to_target"], data["target_vocab"])
