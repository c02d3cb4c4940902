"""Knowledge distillation on a real daemon: the teacher's outputs served from the cache train the student
exactly as the teacher recomputed; other teachers get no hits; top-k round-trips; moving teachers stop."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache_client.bert import BertConfig, BertForSequenceClassification

N, BATCH, CLASSES = 64, 16, 4


class Items(Dataset):
    def __init__(self, classes: int = CLASSES) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randint(0, classes, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def jitter(item, generator: torch.Generator):
    x, y = item
    return x + 0.1 * torch.randn(x.shape, generator=generator), y


def teacher_net(classes: int = CLASSES) -> nn.Module:
    torch.manual_seed(1)  # "trained": fixed weights; dropout must be off when it teaches
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, classes))


def student_net() -> ac.StagedModel:
    torch.manual_seed(2)
    return ac.from_sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, CLASSES)))


def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def loader_for(models, data: Items, *, shuffle: bool = True, augment=jitter, variants=2) -> ac.CachedLoader:
    dataset = ac.IndexedDataset(data, augment=augment, targets=data.y)
    return ac.CachedLoader(
        DataLoader(dataset, batch_size=BATCH, shuffle=shuffle, generator=torch.Generator().manual_seed(1)),
        models, variants=variants if augment is not None else None,
    )


def distill(connection, *, epochs: int = 4, student_frozen: int = 1):
    """A student (itself a CachedForward, its first layer frozen) taught by a CachedTeacher; one loader."""
    data = Items()
    staged = student_net()
    student = ac.CachedForward(staged, connection, audit=False)
    teacher = ac.CachedTeacher(teacher_net(), connection, audit=False)
    loader = loader_for([student, teacher], data)
    student.set_frozen(student_frozen)
    opt = torch.optim.SGD(staged.parameters(), lr=0.1)
    losses, loads = [], []
    for _ in range(epochs):
        before = loader.raw_items_loaded
        for batch in loader:
            logits = student(batch)
            loss = ac.distillation_loss(logits, teacher(batch), temperature=2.0) + 0.5 * F.cross_entropy(logits, batch.data[1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        loads.append(loader.raw_items_loaded - before)
        if connection is not None:
            connection.flush(timeout_s=30)
    return losses, loads, staged, teacher


@pytest.mark.parametrize("student_frozen, loads", [(1, [N, N, 0, 0]), (0, [N] * 4)],
                         ids=["student-cached-too", "student-needs-inputs"])
@pytest.mark.slow
def test_a_student_taught_from_the_cache_trains_as_with_the_teacher_recomputed(daemon, student_frozen, loads):
    """Two augmentation variants: epochs 0 and 1 store the teacher's outputs, 2 and 3 are served. An input
    is left unloaded only when both the student's frozen prefix and the teacher are served."""
    off, off_loads, off_student, _ = distill(None, student_frozen=student_frozen)
    assert off_loads == [N] * 4
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        on, on_loads, on_student, teacher = distill(conn, student_frozen=student_frozen)
    assert on_loads == loads
    assert teacher.times.cached_samples == 2 * N and teacher.times.computed_samples == 2 * N
    assert max(abs(a - b) for a, b in zip(off, on)) <= 1e-5
    for a, b in zip(off_student.parameters(), on_student.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def forward_epochs(teacher: ac.CachedTeacher, loader: ac.CachedLoader, epochs: int = 1) -> list[dict[int, ac.TeacherOutput]]:
    """The teacher's outputs, per epoch, by sample id (one row each)."""
    out = []
    for _ in range(epochs):
        rows: dict[int, ac.TeacherOutput] = {}
        for batch in loader:
            served = teacher(batch)
            for row, sample in enumerate(batch.ids.tolist()):
                rows[sample] = ac.TeacherOutput(
                    **{k: getattr(served, k)[row] for k in ("logits", "top_values", "top_indices", "mask")
                       if getattr(served, k) is not None},
                    hidden={name: h[row] for name, h in served.hidden.items()})
        out.append(rows)
        if teacher.connection is not None:
            teacher.connection.flush(timeout_s=30)
    return out


def test_a_changed_teacher_gets_no_hits(daemon):
    data = Items()
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        teacher = teacher_net()
        first = ac.CachedTeacher(teacher, conn)
        forward_epochs(first, loader_for(first, data))
        perturbed = copy.deepcopy(teacher)
        with torch.no_grad():
            perturbed[0].weight[3, 5] += 1e-4
        changed = ac.CachedTeacher(perturbed, conn)
        assert changed.fingerprint() != first.fingerprint()
        forward_epochs(changed, loader_for(changed, data))
        assert changed.times.cached_samples == 0 and changed.times.computed_samples == N
        again = ac.CachedTeacher(copy.deepcopy(teacher), conn)  # the same weights: served
        forward_epochs(again, loader_for(again, data))
        assert again.times.cached_samples == N
        other_outputs = ac.CachedTeacher(copy.deepcopy(teacher), conn, top_k=2)  # other outputs: other keys
        forward_epochs(other_outputs, loader_for(other_outputs, data))
        assert other_outputs.times.cached_samples == 0


def test_top_k_storage_round_trips_exactly_the_k_largest_logits(daemon):
    classes, k = 100, 5
    data = Items(classes)
    net = teacher_net(classes)
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        teacher = ac.CachedTeacher(net, conn, top_k=k)
        stored, served = forward_epochs(teacher, loader_for(teacher, data, shuffle=False, augment=None), epochs=2)
        assert teacher.times.cached_samples == N
        per_entry = conn.stats.bytes_written / N
        full = ac.CachedTeacher(copy.deepcopy(net), conn)
        forward_epochs(full, loader_for(full, data, shuffle=False, augment=None))
        assert conn.stats.bytes_written / N - per_entry > 4 * (classes - 2 * k)  # 100 fp32 vs 5 fp32 + 5 int32
    with torch.no_grad():
        reference = net.eval()(data.x).topk(k, dim=-1)
    for i in range(N):
        assert torch.equal(served[i].top_values, stored[i].top_values)
        assert torch.equal(served[i].top_indices, stored[i].top_indices)
        torch.testing.assert_close(served[i].top_values, reference.values[i], rtol=0, atol=1e-6)
        assert torch.equal(served[i].top_indices, reference.indices[i])
        assert served[i].logits is None


class Sentences(Dataset):
    """Token ids of random length (the [CLS]-like first token is never padding) and labels."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        lengths = torch.randint(2, 12, (N,), generator=g).tolist()
        self.ids = [torch.randint(1, 50, (n,), generator=g) for n in lengths]
        self.y = torch.randint(0, 2, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.ids[i], self.y[i]


def pad(items):
    longest = max(len(ids) for ids, _ in items)
    ids = torch.zeros(len(items), longest, dtype=torch.int64)
    mask = torch.zeros(len(items), longest, dtype=torch.int64)
    for row, (seq, _) in enumerate(items):
        ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    return (ids, mask), torch.stack([y for _, y in items])


def test_text_teacher_hidden_states_are_stored_without_padding_and_served_with_audits(daemon):
    torch.manual_seed(3)
    bert = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=16))
    data = Sentences()
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:  # strict: an audit mismatch raises
        teacher = ac.CachedTeacher(bert, conn, outputs=("logits", "bert.encoder.layer.0"), varlen=ac.VarLen())
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=BATCH, shuffle=True,
                                            generator=torch.Generator().manual_seed(1), collate_fn=pad), teacher)
        stored, served = forward_epochs(teacher, loader, epochs=2)
    assert teacher.times.cached_samples == N and teacher.times.audited_samples >= 8
    for i in range(N):
        length = len(data.ids[i])
        hidden = served[i].hidden["bert.encoder.layer.0"]
        assert served[i].mask[:length].all() and not served[i].mask[length:].any()
        assert not hidden[length:].any()  # padding is zeros, served or computed
        torch.testing.assert_close(hidden[:length], stored[i].hidden["bert.encoder.layer.0"][:length], rtol=0, atol=1e-5)
        torch.testing.assert_close(served[i].logits, stored[i].logits, rtol=0, atol=1e-5)
    with torch.no_grad():  # and what was stored is the teacher's own output
        logits = bert.eval()(data.ids[0][None], torch.ones(1, len(data.ids[0]), dtype=torch.int64))
    torch.testing.assert_close(served[0].logits, logits[0], rtol=0, atol=1e-5)


def test_a_teacher_whose_weights_change_between_epochs_stops_being_cached(daemon):
    """An EMA teacher: its weights follow the student's. The second epoch's start sees it, warns once,
    drops what the first epoch stored, and the teacher is recomputed from then on."""
    data = Items()
    staged = student_net()
    net = copy.deepcopy(staged)
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        student = ac.CachedForward(staged, None)
        teacher = ac.CachedTeacher(net, conn)
        loader = loader_for([student, teacher], data)
        opt = torch.optim.SGD(staged.parameters(), lr=0.1)

        def epoch() -> None:
            for batch in loader:
                logits = student(batch)
                taught = teacher(batch)
                with torch.no_grad():
                    torch.testing.assert_close(taught.logits, net.eval()(batch.data[0]), rtol=0, atol=1e-6)
                loss = ac.distillation_loss(logits, taught) + F.cross_entropy(logits, batch.data[1])
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    for t, s in zip(net.parameters(), staged.parameters()):
                        t.mul_(0.9).add_(0.1 * s)
            conn.flush(timeout_s=30)

        epoch()
        first = teacher.fingerprint()
        assert teacher.times.computed_samples == N and conn.contains(first, 1, [0, 1, 2], 0) == [True] * 3
        with pytest.warns(ac.MovingTeacherWarning, match="moving teacher"):
            epoch()
        epoch()  # warned once: any further warning would fail the test
        assert not teacher.enabled and teacher.moved
        assert teacher.times.cached_samples == 0 and teacher.times.computed_samples == 3 * N
        assert conn.contains(first, 1, list(range(N)), 0) == [False] * N  # what the first epoch stored is gone


def test_top_k_in_16_bits_keeps_the_classes_exact_and_rounds_the_values(daemon):
    classes, k = 100, 5
    data = Items(classes)
    net = teacher_net(classes)
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        teacher = ac.CachedTeacher(net, conn, top_k=k, store_dtype=torch.float16)
        assert teacher.fingerprint() != ac.CachedTeacher(net, conn, top_k=k).fingerprint()
        stored, served = forward_epochs(teacher, loader_for(teacher, data, shuffle=False, augment=None), epochs=2)
    assert teacher.times.cached_samples == N
    for i in range(N):
        assert torch.equal(served[i].top_indices, stored[i].top_indices)
        assert served[i].top_values.dtype == torch.float32
        assert torch.equal(served[i].top_values, stored[i].top_values.half().float())
