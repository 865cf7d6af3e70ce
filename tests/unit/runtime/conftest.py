"""Fixtures for runtime unit tests (helpers live in ``runtime_fakes`` and ``omni_fakes``)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

# pytest runs with --import-mode=importlib, which puts no test directory on sys.path; the test modules
# here share runtime_fakes.py and omni_fakes.py (plain helpers, not fixtures), so this directory goes on the
# path first.
sys.path.insert(0, str(Path(__file__).parent))

from omni_fakes import OmniServe
from runtime_fakes import FakeServe, asgi_client, lifespan, openai_client


@pytest.fixture
async def fake_serve() -> AsyncIterator[FakeServe]:
    serve = FakeServe()
    async with lifespan(serve.app):
        yield serve


@pytest.fixture
async def http(fake_serve: FakeServe) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(fake_serve.app) as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


@pytest.fixture
async def omni() -> AsyncIterator[OmniServe]:
    """The fake omni stages (omni_fakes.py) behind the gateway app, started."""
    serve = OmniServe()
    async with lifespan(serve.app):
        yield serve


@pytest.fixture
async def omni_http(omni: OmniServe) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(omni.app) as client:
        yield client
