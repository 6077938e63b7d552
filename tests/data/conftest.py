"""Fixtures for the data tests (the helpers they use are in ``tests/data/helpers.py``)."""

from __future__ import annotations

import os

import pytest

from tests.data.helpers import ImageServer, make_shards

UNEVEN_SIZES = [23, 17, 30, 12, 26, 20]
"""128 samples in six shards of unequal size."""


@pytest.fixture(scope="session")
def uneven_shards(tmp_path_factory) -> tuple[str, list[int]]:
    """(pattern, good ids) of six clean shards of unequal sizes."""
    directory = tmp_path_factory.mktemp("uneven")
    good = make_shards(directory, UNEVEN_SIZES)
    return os.path.join(str(directory), "{00000..00005}.tar"), good


@pytest.fixture
def image_server(monkeypatch):
    # img2dataset uses urllib, which honours *_proxy variables; keep the loopback direct.
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")
    server = ImageServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
