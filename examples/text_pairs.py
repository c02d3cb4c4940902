"""Sentence pairs through a BERT classifier with actcache: batches are dicts, as Hugging Face collators give,
or nested tuples, as ``collate_tokens`` gives.

A small BERT built from a config (no weights downloaded) classifies pairs of token-id sequences; its
embeddings and first layer freeze after the first epoch and are served from the cache from then on.
``load_minilm(num_labels, max_length=128)`` gives the pretrained all-MiniLM-L6-v2 in the same layout.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache_client.bert import BertConfig, BertForSequenceClassification, collate_tokens

CONFIG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


class Pairs(Dataset):
    """Token-id pairs ``[CLS] a [SEP] b [SEP]`` of varying length, tokenized in the dataset."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for _ in range(n):
            a, b = (torch.randint(3, 64, (int(torch.randint(2, 8, ())),), generator=g) for _ in range(2))
            ids = torch.cat([torch.tensor([1]), a, torch.tensor([2]), b, torch.tensor([2])])
            types = torch.cat([torch.zeros(len(a) + 2, dtype=torch.int64), torch.ones(len(b) + 1, dtype=torch.int64)])
            self.items.append((ids, types))
        self.targets = [i % 2 for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i], self.targets[i]


def collate(items):
    """A dict batch padded on the right: input_ids, attention_mask, token_type_ids, labels."""
    (input_ids, attention_mask, token_type_ids), labels = collate_tokens(items)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids, "labels": labels}


def train(epochs: int = 3, cached: bool = True, nested: bool = False) -> tuple[list[float], int]:
    """The losses of every step, and how many frozen-prefix outputs the cache served; ``nested``: batches as
    ``collate_tokens`` gives them, ``((input_ids, attention_mask, token_type_ids), labels)``, not dicts."""
    torch.manual_seed(0)
    net = BertForSequenceClassification(CONFIG)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loader = DataLoader(Pairs(), batch_size=8, shuffle=True, collate_fn=collate_tokens if nested else collate,
                        generator=torch.Generator().manual_seed(1))
    # finds the BERT layout; stores states without padding. planner=None: a prefix this small is cheaper to
    # recompute than to fetch, which the default cost model would find; this example shows the cache serving.
    cache = ac.ActCache(net, planner=None) if cached else None
    if cache is not None:
        loader = cache.wrap(loader)
    losses = []
    for epoch in range(epochs):
        net.train()
        if epoch >= 1:
            if cache is not None:
                cache.freeze(2)  # the embeddings and encoder layer 0
            else:
                for m in (net.bert.embeddings, net.bert.encoder.layer[0]):
                    m.requires_grad_(False).eval()
        for batch in loader:
            if nested:
                (input_ids, attention_mask, token_type_ids), labels = batch
            else:
                input_ids, attention_mask, token_type_ids = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
                labels = batch["labels"]
            logits = net(input_ids, attention_mask, token_type_ids)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    hits = 0
    if cache is not None:
        hits = cache.connection.stats.hits
        cache.close()
    return losses, hits


if __name__ == "__main__":
    print(train())
