"""A changed document is served from its old chunks until its new ones are precomputed, then swapped
in one transaction (corpus/versions.py): the state in between, the swap, the last write winning, a
delete meanwhile, and a run killed before its swap. A second service on the same database stands for
another replica: its index follows SQL by the index version alone."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import func, select

from ragcache.config import Settings
from ragcache.jobs import precompute
from ragcache.jobs.precompute import run_precompute
from ragcache.meta import Chunk, KVCopy
from ragcache.service import RagCache

OLD = " ".join(f"River {i} flows past the old mill at the edge of town." for i in range(16))
NEW = " ".join(f"Mountain {i} rises above the valley of grey stone." for i in range(30))
NEWER = " ".join(f"Lake {i} lies still below the dark pine forest." for i in range(24))
QUERY = "river mill mountain valley lake forest"  # a's chunks of every version match it


def _settings(home: Path, smollm, **extra) -> Settings:
    return Settings(home=home, model=str(smollm.path), chunk_tokens=96, precompute_batch=2, max_new_tokens=2,
                    **extra)


def _docs(path: Path, text: str) -> Path:
    """Document `a` with `text`, beside an unchanging `other`."""
    path.write_text(json.dumps({"id": "a", "text": text}) + "\n" + json.dumps({"id": "other", "text": "Paris."}) + "\n")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm) -> Path:
    """A home whose documents `a` (OLD) and `other` are precomputed; each test works on a copy."""
    home = tmp_path_factory.mktemp("served") / "home"
    with RagCache(_settings(home, smollm)) as service:
        service.ingest(_docs(home.parent / "docs.jsonl", OLD))
        run_precompute(service.settings, progress=False, service=service)
    return home


@pytest.fixture
def service(served, tmp_path, smollm):
    shutil.copytree(served, tmp_path / "home")
    with RagCache(_settings(tmp_path / "home", smollm)) as svc:
        yield svc


@pytest.fixture
def replica(service, tmp_path, smollm):
    """Another process's service: its own home (index, disk tier), the same database."""
    with RagCache(Settings(home=tmp_path / "replica", model=str(smollm.path),
                           database_url=service.settings.db_url)) as other:
        yield other


def _versions(service) -> tuple[set[int], set[int]]:
    """a's served chunk ids, and its staged ones."""
    doc = service.corpus.document("default", "a")
    return set(doc["chunk_ids"]), set((doc.get("staged") or {}).get("chunk_ids", []))


def _found(service) -> set[int]:
    """Ids of a's chunks that a search finds (every chunk of the namespace is within k)."""
    return {hit.id for hit in service.search(QUERY, k=20) if hit.doc_id == "a"}


def _words(service, ids) -> set[str]:
    """The first word of each of these chunks' texts: which version they are of."""
    with service.db.session() as s:
        return {text.split()[0] for text in s.scalars(select(Chunk.text).where(Chunk.id.in_(ids)))}


def _staged_done(service) -> int:
    with service.db.session() as s:
        return s.scalar(select(func.count()).select_from(Chunk).where(Chunk.staged, Chunk.state == "done"))


def _no_orphans(service) -> set[str]:
    """The KV keys chunks name, after checking that every copy row and blob has one; returns them."""
    with service.db.session() as s:
        keys = set(s.scalars(select(Chunk.kv_key).where(Chunk.kv_key.is_not(None))))
        copies = set(s.scalars(select(KVCopy.key)))
    assert copies == keys and set(service.store.blobs[0].keys()) == keys
    return keys


def _on_prefill(service, at: int, act) -> list:
    """Run `act()` before the `at`-th prefill of the precompute (1-based; batches of 2: the 3rd prefill
    comes after the first batch committed) and before every later one when `at` is 0; its results."""
    real, calls, results = service.prefill_for_store, [], []

    def prefill(ids, namespace):
        calls.append(1)
        if at == 0 or len(calls) == at:
            results.append(act())
        return real(ids, namespace)

    service.prefill_for_store = prefill
    return results


def test_between_a_change_and_its_precompute_the_old_chunks_are_served(service, replica, tmp_path):
    old, _ = _versions(service)
    assert _found(replica) == old
    report = service.ingest(_docs(tmp_path / "docs.jsonl", NEW))
    assert _found(service) == old and _found(replica) == old
    assert (report.replaced, report.staged, report.chunks_removed, report.orphan_kv_keys) == (1, 1, 0, [])
    served, staged = _versions(service)
    assert served == old and staged and not staged & old
    doc = service.corpus.document("default", "a")
    assert doc["chunks_by_state"] == {"done": len(old)} and doc["staged"]["chunks_by_state"] == {"pending": len(staged)}
    out = service.generate("Which river flows past the old mill?", top_k=3)
    mine = [c for c in out["chunks"] if c["doc_id"] == "a"]
    assert mine and {c["id"] for c in mine} <= old and {c["tier"] for c in mine} <= {"cpu", "disk"}  # stored KV


def test_the_new_chunks_are_swapped_in_together_once_all_are_done(service, replica, tmp_path):
    old, _ = _versions(service)
    assert _found(replica) == old
    service.ingest(_docs(tmp_path / "docs.jsonl", NEW))
    _, staged = _versions(service)
    assert len(staged) >= 3  # more than a batch: some new chunks are done while others are not
    seen = _on_prefill(service, 0, lambda: (_staged_done(service), _found(service), _found(replica)))
    run_precompute(service.settings, progress=False, service=service)
    assert any(done for done, _, _ in seen)
    assert all(here == old and there == old for _, here, there in seen), seen  # never a mix, never none
    served, after = _versions(service)
    assert served == staged and not after
    assert _found(service) == staged and _found(replica) == staged  # the replica re-synced from SQL
    with service.db.session() as s:
        assert service.index.ids("default") == set(s.scalars(select(Chunk.id)))
        gone = s.scalar(select(func.count()).select_from(Chunk).where(Chunk.id.in_(old)))
    assert gone == 0 and len(_no_orphans(service)) == len(staged) + 1  # the old KV left with the old chunks


def test_a_change_while_staged_replaces_the_staged_version_the_last_write_wins(service, tmp_path):
    old, _ = _versions(service)
    docs = tmp_path / "docs.jsonl"
    service.ingest(_docs(docs, NEW))
    _, first = _versions(service)

    def change():  # NEWER arrives (over HTTP, say) after NEW's first batch is done
        return service.ingest(_docs(docs, NEWER)), _versions(service), _found(service)

    seen = _on_prefill(service, 3, change)
    run_precompute(service.settings, progress=False, service=service)
    [(report, (served, staged), found)] = seen
    assert served == old and found == old  # NEW is gone, OLD still served
    assert (report.staged, report.chunks_removed) == (1, len(first)) and len(report.orphan_kv_keys) == 2
    assert _versions(service) == (staged, set()) and _found(service) == staged  # NEWER, swapped in
    assert _words(service, staged) == {"Lake"}
    _no_orphans(service)

    service.ingest(_docs(docs, OLD))  # OLD again, staged; then NEWER once more: the staged OLD is dropped
    back = service.ingest(_docs(docs, NEWER))
    assert (back.staged, back.chunks_added, back.chunks_removed) == (0, 0, len(old))
    assert _versions(service) == (staged, set()) and "pending" not in service.counts()


def test_a_delete_while_staged_removes_both_versions(service, tmp_path):
    old, _ = _versions(service)
    service.ingest(_docs(tmp_path / "docs.jsonl", NEW))
    _, staged = _versions(service)
    assert _found(service) == old
    deleted = _on_prefill(service, 3, lambda: service.corpus.delete_document("default", "a"))
    run_precompute(service.settings, progress=False, service=service)
    assert deleted[0]["chunks_removed"] == len(old) + len(staged)
    assert deleted[0]["kv_entries_removed"] == len(old) + 2  # and the first batch's new entries
    with service.db.session() as s:
        left = set(s.scalars(select(Chunk.id)))
    assert len(left) == 1 and service.index.ids("default") == left and not _found(service)  # `other` alone
    assert len(_no_orphans(service)) == 1


class Killed(BaseException):
    """The run dies where it stands: what it committed stays, as after a SIGKILL."""


def test_a_run_killed_between_its_last_new_chunk_and_the_swap_swaps_when_it_resumes(service, tmp_path, monkeypatch):
    old, _ = _versions(service)
    service.ingest(_docs(tmp_path / "docs.jsonl", NEW))
    _, staged = _versions(service)
    real = precompute.swap_ready

    def killed_before_a_swap(db, namespace=None, chunk_ids=None):
        if _staged_done(service) == len(staged):
            raise Killed
        return real(db, namespace, chunk_ids)

    monkeypatch.setattr(precompute, "swap_ready", killed_before_a_swap)
    with pytest.raises(Killed):
        run_precompute(service.settings, progress=False, service=service)
    monkeypatch.undo()
    assert service.corpus.document("default", "a")["staged"]["chunks_by_state"] == {"done": len(staged)}
    assert _versions(service) == (old, staged) and _found(service) == old  # every new chunk done, not swapped
    assert run_precompute(service.settings, progress=False, service=service).done == 0  # nothing to compute
    assert _versions(service) == (staged, set()) and _found(service) == staged
    _no_orphans(service)
