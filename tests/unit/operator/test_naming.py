"""Child names: valid Service names, bounded, stable, collision-free."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from omnimodel_operator import naming

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# OmniModel names are DNS-1123 subdomains: up to 253 chars, dots allowed, may start with a digit.
cr_names = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,120}[a-z0-9])?", fullmatch=True)
stage_names = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", fullmatch=True)


@given(cr_names, stage_names)
def test_child_names_are_dns_labels_of_at_most_63_chars(cr: str, stage: str) -> None:
    name = naming.stage_name(cr, stage)
    assert len(name) <= 63
    assert DNS_1035.match(name), name
    assert naming.stage_name(cr, stage) == name  # stable across calls (and runs: no randomness)


@given(cr_names, stage_names, stage_names)
def test_different_stages_get_different_names(cr: str, a: str, b: str) -> None:
    if a != b:
        assert naming.stage_name(cr, a) != naming.stage_name(cr, b)


def test_short_valid_names_are_kept_readable() -> None:
    assert naming.stage_name("qwen-omni", "thinker") == "qwen-omni-thinker"
    assert naming.gateway_name("qwen-omni") == "qwen-omni-gateway"


def test_long_names_are_cut_with_a_hash_so_they_do_not_collide() -> None:
    a = naming.stage_name("m" * 70 + "a", "thinker")
    b = naming.stage_name("m" * 70 + "b", "thinker")
    assert len(a) == len(b) == 63
    assert a != b


def test_dotted_and_digit_names_become_valid_service_names() -> None:
    name = naming.stage_name("7b.chat", "llm")
    assert DNS_1035.match(name)
    assert name != naming.stage_name("7b-chat", "llm")


def test_selectors_use_only_our_stable_labels() -> None:
    selector = naming.stage_selector("m", "talker")
    assert set(selector) == {
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
        "omnimodel.io/stage",
    }
    assert selector.items() <= naming.stage_labels("m", "talker").items()
