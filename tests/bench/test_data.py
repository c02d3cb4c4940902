import importlib
from pathlib import Path

import pytest
import torch
from workloads import data
from workloads.data import DataNotFound, pad_collate, read_cifar10, read_glue, resolve_data_dir, subset

from tests.bench.fake_data import make_data_dir


def shared_data():
    try:
        return resolve_data_dir()
    except DataNotFound as exc:
        pytest.skip(f"the shared benchmark data is absent: {exc}")


@pytest.mark.parametrize("module", ["workloads.data", "workloads.freezers", "workloads.report", "workloads.tasks",
                                    "workloads.trainer"])
def test_public_surface_is_explicit_and_sorted(module):
    mod = importlib.import_module(module)
    assert list(mod.__all__) == sorted(mod.__all__)
    assert all(hasattr(mod, name) for name in mod.__all__)


def test_data_dir_comes_from_the_flag_then_the_environment_then_beside_the_repo(tmp_path, monkeypatch):
    flag, env = tmp_path / "flag", tmp_path / "env"
    flag.mkdir(), env.mkdir()
    monkeypatch.setenv("ACTCACHE_DATA", str(env))
    assert resolve_data_dir(flag) == flag
    assert resolve_data_dir(None) == env
    monkeypatch.delenv("ACTCACHE_DATA")
    monkeypatch.setattr(data, "REPO", tmp_path / "repo")
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert resolve_data_dir(None) == tmp_path / "shared" / "data"
    (tmp_path / "shared" / "data").rmdir()
    with pytest.raises(DataNotFound, match=r"--data-dir=.*missing \(not a directory\).*shared/data \(absent\).*ACTCACHE_DATA"):
        resolve_data_dir(tmp_path / "missing")


def test_missing_files_are_named_with_where_we_looked(tmp_path):
    with pytest.raises(DataNotFound, match=r"cifar10/test.npz is missing .*directory absent"):
        read_cifar10(tmp_path, "test")
    with pytest.raises(DataNotFound, match="MRPC, for one, is not in"):
        read_glue(tmp_path, "mrpc", "train")


def test_readers_parse_the_documented_formats(tmp_path):
    root = make_data_dir(tmp_path)
    images, labels = read_cifar10(root, "train")
    assert images.shape == (48, 3, 32, 32) and images.dtype == torch.uint8 and labels.dtype == torch.int64
    few, few_labels = read_cifar10(root, "train", limit=10, seed=3)
    again, _ = read_cifar10(root, "train", limit=10, seed=3)
    assert few.shape[0] == 10 and torch.equal(few, again)
    assert set(few_labels.tolist()) <= set(labels.tolist())
    sst, sst_labels = read_glue(root, "sst2", "train")
    cola, cola_labels = read_glue(root, "cola", "train")
    assert len(sst) == len(cola) == 24 and set(sst_labels) <= {0, 1}
    assert not sst[0].endswith(" ") and cola[0].endswith(".")
    assert sst_labels == cola_labels


def test_real_files_have_the_documented_row_counts():
    shared = shared_data()
    assert [len(read_glue(shared, "sst2", s)[0]) for s in ("train", "dev")] == [67349, 872]
    assert [len(read_glue(shared, "cola", s)[0]) for s in ("train", "dev")] == [8551, 1043]
    images, labels = read_cifar10(shared, "test", limit=20)
    assert images.shape == (20, 3, 32, 32) and int(labels.max()) <= 9


def test_subset_is_fixed_by_its_seed_and_pad_collate_pads_right():
    assert subset(100, 10, 0) == subset(100, 10, 0) != subset(100, 10, 1)
    assert subset(5, None) == subset(5, 9) == [0, 1, 2, 3, 4]
    (ids, mask), y = pad_collate([(torch.tensor([101, 7, 102]), torch.tensor(1)), (torch.tensor([101, 102]), torch.tensor(0))])
    assert ids.tolist() == [[101, 7, 102], [101, 102, 0]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert y.tolist() == [1, 0]


def test_shared_dir_default_is_beside_the_repository():
    assert data.REPO == Path(__file__).resolve().parents[2]
