"""Real metadata servers: a SQLite file and PostgreSQL at 127.0.0.1:5432; Redis at 127.0.0.1:6379.

An unreachable server fails the test (it is not skipped): CI runs where both are up.
"""
from __future__ import annotations

import os
import uuid

import psycopg
import pytest
import torch

from blend import ChunkKV
from ragcache.database import Database

PG_ADMIN = os.environ.get("RAGCACHE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RAGCACHE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def pg_database():
    """A fresh PostgreSQL database: (sqlalchemy url, drop callback)."""
    name = f"ragcache_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop():
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    return f"{base}/{name}", drop


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'meta.db'}"
        return
    url, drop = pg_database()
    yield url
    drop()


@pytest.fixture
def db(db_url):
    database = Database(db_url)
    yield database
    database.dispose()


@pytest.fixture
def redis_token():
    """A private deployment token in the real Redis (keys `ragcache:<token>:…`), emptied afterwards."""
    import redis

    token = f"test{uuid.uuid4().hex[:8]}"
    yield token
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"ragcache:{token}:*"))
    if keys:
        client.delete(*keys)


def fake_chunk(seed: int, n: int = 16, layers: int = 4, heads: int = 2, hd: int = 8) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randint(0, 1000, (n,), generator=g), torch.randn(layers, heads, n, hd, generator=g),
                   torch.randn(layers, heads, n, hd, generator=g), 0, "")
