"""transformers.Trainer with actcache attached: same losses as without the cache, evaluate, resume, errors,
a FreezeController deciding."""

from __future__ import annotations

import importlib.util
import itertools
import random
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

pytest.importorskip("transformers", reason="the huggingface extra (actcache[huggingface]) is not installed")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaForSequenceClassification,
    Trainer,
    TrainingArguments,
)

import actcache_client as ac  # noqa: E402
from actcache.errors import ConfigError  # noqa: E402
from actcache_client._dropin import ActCache  # noqa: E402
from actcache_client.integrations.huggingface import attach, load_transformers_minilm  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORDS = ["good", "bad", "great", "awful", "film", "plot", "very", "not", "the", "a"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def sentences(n: int, seed: int) -> list[dict]:
    rng, tok = random.Random(seed), tokenizer()
    out = []
    for _ in range(n):
        text = " ".join(rng.choices(WORDS, k=rng.randint(2, 10)))
        out.append({**tok(text), "label": int(text.count("good") > text.count("bad"))})
    return out


def model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=16, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=40)
    if family == "roberta":
        return RobertaForSequenceClassification(RobertaConfig(**shape, pad_token_id=0))
    return BertForSequenceClassification(BertConfig(**shape))


def trainer(net, out: Path, *, fixed: bool = False, epochs: int = 3, save_steps: int | None = None) -> Trainer:
    args = TrainingArguments(output_dir=str(out), num_train_epochs=epochs, per_device_train_batch_size=8,
                             logging_steps=1, report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    padding = {"padding": "max_length", "max_length": 16} if fixed else {}
    return Trainer(model=net, args=args, train_dataset=sentences(48, 1), eval_dataset=sentences(16, 2),
                   data_collator=DataCollatorWithPadding(tokenizer(), **padding))


def losses(t: Trainer) -> list[float]:
    return [row["loss"] for row in t.state.log_history if "loss" in row]


@pytest.fixture
def connection():
    c = ac.connect(embedded=True)
    yield c
    c.close()


@pytest.mark.parametrize("family, fixed", [("bert", True), ("roberta", False)])
def test_cached_run_has_the_losses_of_the_same_freeze_without_the_cache(tmp_path, connection, family, fixed):
    plain = trainer(model(family), tmp_path / "plain", fixed=fixed)
    attach(plain, depth=3, freeze_at=0.25, cache=False)
    plain.train()
    cached = trainer(model(family), tmp_path / "cached", fixed=fixed)
    hooked = attach(cached, depth=3, freeze_at=0.25, connection=connection, planner=None)
    cached.train()
    if fixed:  # every row at one length: the served prefix is the computed one, bit for bit
        assert losses(cached) == losses(plain)
    else:  # attention at another padded length may round the last bits differently
        assert losses(cached) == pytest.approx(losses(plain), rel=1e-5)
    assert cached.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    served = [c.times.cached_samples for c in hooked.cache.model.epoch_counters()]
    assert served[0] == 0 and served[-1] == 48  # the last epoch is served whole
    assert not any(p.requires_grad for p in cached.model.base_model.embeddings.parameters())


def test_evaluate_neither_reads_nor_writes_the_cache(tmp_path, connection):
    t = trainer(model("bert"), tmp_path, epochs=2)
    hooked = attach(t, depth=2, freeze_at=0, connection=connection, planner=None)
    t.train()
    stats = connection.stats
    before = (stats.puts, stats.hits, stats.misses, hooked.cache.model.times.prefix_samples)
    first = t.evaluate()["eval_loss"]
    assert t.evaluate()["eval_loss"] == first
    assert (stats.puts, stats.hits, stats.misses, hooked.cache.model.times.prefix_samples) == before
    assert before[0] > 0


def test_resume_from_a_checkpoint_gives_the_uninterrupted_run(tmp_path, connection):
    whole = trainer(model("bert"), tmp_path / "whole", fixed=True)
    attach(whole, depth=3, freeze_at=2, connection=connection, planner=None)
    whole.train()
    first = trainer(model("bert"), tmp_path / "run", fixed=True, save_steps=8)
    attach(first, depth=3, freeze_at=2, connection=connection, planner=None)
    first.train()
    resumed = trainer(model("bert"), tmp_path / "run", fixed=True)
    hooked = attach(resumed, depth=3, freeze_at=2, connection=connection, planner=None)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-8"))
    assert losses(resumed)[-10:] == losses(whole)[-10:]  # steps 9..18: half an epoch computed, one served
    assert resumed.evaluate()["eval_loss"] == whole.evaluate()["eval_loss"]
    assert hooked.cache.model.epoch_counters()[-1].times.cached_samples == 48


def test_a_padded_text_state_without_varlen_is_named_at_the_first_put(tmp_path, connection):
    net = model("bert")
    t = trainer(net, tmp_path)
    cache = ActCache(net, connection, varlen=None)  # text states stored at the batch's padded length
    cache.freeze(2)
    batches = iter(cache.wrap(t.get_train_dataloader().base_dataloader))
    batch = next(batches)
    net.train()
    with pytest.raises(ConfigError, match=r"varlen=VarLen\(\)"):
        net(**batch)


def test_a_collate_output_the_cache_cannot_split_is_named(tmp_path, connection):
    net = model("bert")
    cache = ActCache(net, connection)
    rows = sentences(8, 3)

    def as_lists(items: list[dict]) -> dict:  # no return_tensors: lists of token ids
        return {"input_ids": [item["input_ids"] for item in items]}

    loader = cache.wrap(torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=as_lists))
    with pytest.raises(ConfigError, match="return tensors from the collate_fn"):
        next(iter(loader))


def test_load_transformers_minilm_gives_the_encoder_of_our_own_minilm():
    from actcache_client.bert import load_minilm as our_minilm

    theirs, tokenizer = load_transformers_minilm(num_labels=3)
    ours, _ = our_minilm(num_labels=3)
    batch = tokenizer(["a film of quiet wit", "no"], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = theirs.eval().bert(**batch).last_hidden_state
        our_hidden, _ = ours.eval().bert(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert theirs.classifier.out_features == 3
    mask = batch["attention_mask"].bool()
    assert torch.allclose(hidden[mask], our_hidden[mask], atol=1e-5)


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")  # GPU-ready scripts, on a CPU
def test_the_examples_run_and_differ_by_the_lines_that_add_actcache(tmp_path, monkeypatch):
    with ac.connect(embedded=True) as node:  # the actcache example connects to "this node's daemon"
        monkeypatch.setenv("ACTCACHE_SOCKET", node.config.socket)
        argv = ["--tiny", "--samples", "400", "--epochs", "2"]  # 10 steps an epoch, frozen from step 5
        plain = _example("huggingface_finetune").main([*argv, "--output", str(tmp_path / "p")])
        cached = _example("huggingface_finetune_actcache").main([*argv, "--output", str(tmp_path / "c")])
    assert losses(cached)[0] == losses(plain)[0]  # steps 1..5, before the freeze: the same run
    hooked = next(c.owner for c in cached.callback_handler.callbacks if hasattr(c, "owner"))
    assert hooked.cache.model.epoch_counters()[-1].times.cached_samples > 0
    assert 0.0 <= cached.state.log_history[-1]["eval_accuracy"] <= 1.0
    added = set((EXAMPLES / "huggingface_finetune_actcache.py").read_text().splitlines()) - \
        set((EXAMPLES / "huggingface_finetune.py").read_text().splitlines())
    assert len(added) <= 3


def not_freezing(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("actcache: not freezing")]


def test_the_cost_model_is_told_the_trainers_length(tmp_path, connection):
    t = trainer(model("bert"), tmp_path / "run", fixed=True, epochs=2)
    hooked = attach(t, depth=2, freeze_at=0, connection=connection)  # the default cost model
    t.train()
    assert hooked.cache.model.planner.config.total_epochs == 2


def test_without_depth_a_short_run_says_once_that_it_is_too_short_and_trains_as_without_actcache(
        tmp_path, connection, caplog):
    plain = trainer(model("bert"), tmp_path / "plain", fixed=True)
    plain.train()
    auto = trainer(model("bert"), tmp_path / "auto", fixed=True)
    hooked = attach(auto, connection=connection, planner=None)
    auto.train()
    (message,) = not_freezing(caplog)
    assert "a run of 18 steps is too short" in message
    assert hooked.controller.total_steps == auto.state.max_steps == 18  # the Trainer's length
    assert hooked.controller.step_count == 18 and hooked.controller.changes == [] and not hooked.frozen
    assert losses(auto) == losses(plain)


def test_a_policy_drives_the_freeze_and_the_cache_keeps_the_run_of_the_same_freeze_without_it(tmp_path, connection):
    runs = {}
    for name, options in [("by_hand", dict(depth=3, freeze_at=4, cache=False)),
                          ("uncached", dict(policy=ac.StaticPolicy(stages=3, at_step=4), eval_every=1, cache=False)),
                          ("cached", dict(policy=ac.StaticPolicy(stages=3, at_step=4), eval_every=1,
                                          connection=connection, planner=None))]:
        t = trainer(model("bert"), tmp_path / name, fixed=True)
        hooked = attach(t, **options)
        t.train()
        runs[name] = (losses(t), hooked)
    (cached, hooked), (uncached, _), (by_hand, _) = runs["cached"], runs["uncached"], runs["by_hand"]
    assert cached == uncached == by_hand  # frozen after step 4 of 18, every way
    assert hooked.controller.changes == [(4, 0, 3)] and hooked.controller.step_count == 18
    served = [c.times.cached_samples for c in hooked.cache.model.epoch_counters()]
    assert served[0] == 0 and served[-1] == 48  # the last epoch is served whole
    assert not any(p.requires_grad for p in runs["uncached"][1].trainer.model.base_model.embeddings.parameters())


def test_depth_and_a_controller_setting_together_are_refused(tmp_path, connection):
    t = trainer(model("bert"), tmp_path)
    with pytest.raises(ConfigError, match="pass depth= .* or policy= .*not both"):
        attach(t, depth=2, policy=ac.StaticPolicy(stages=2, at_step=1), connection=connection, planner=None)
    with pytest.raises(ConfigError, match=r"freeze_at=0\.5\) needs depth="):
        attach(t, freeze_at=0.5, connection=connection, planner=None)


def test_egeria_gets_plasticity_readings_from_a_transformers_model_serving_its_prefix_in_place(connection):
    net = model("bert")
    cache = ac.ActCache(net, connection)
    loader = cache.wrap(DataLoader(sentences(48, 1), batch_size=8, collate_fn=DataCollatorWithPadding(tokenizer())))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    policy = ac.EgeriaPolicy(ac.EgeriaConfig(window=3, bootstrap_threshold=None))
    with ac.FreezeController(cache.model, opt, policy, eval_every=1,
                             reference=ac.ReferenceConfig(max_cpu_percent=None)) as ctl:
        deadline = time.monotonic() + 240  # the reference process imports transformers before its first reading
        for epoch in itertools.count():
            for batch in loader:
                loss = net(**batch).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                ctl.step(loss, epoch=epoch)
            if ctl.frozen >= 2 or time.monotonic() > deadline:
                break
        stats = ctl.reference_stats
    # Readings of stage 0 (the embeddings, from the batch's own inputs) and of stage 1 (from the served prefix).
    assert ctl.frozen >= 2, f"froze {ctl.frozen} stages in {ctl.step_count} steps: {stats}"
    assert [r["stage"] for r in ctl.timeline.records if r.get("decision") == "freeze_next"][:2] == [0, 1]
