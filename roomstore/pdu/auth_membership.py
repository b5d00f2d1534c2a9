"""The authorization rules of ``m.room.member`` events (rule 5 of room
versions 1-5 and 12, rule 4 of 6-11), every membership transition.

Numbering inside the rule follows the room version's page: from v8 rule
x.2 is the ``join_authorised_via_users_server`` signature, so ``join`` is
x.3, ``invite`` x.4, ``leave`` x.5, ``ban`` x.6, ``knock`` x.7; before v8
``join`` is x.2 and the rest shift down by one.

Readings where the spec leaves room (each as Synapse reads it unless said):

* "membership state" of a user with no member event in the state is none
  of ``join``, ``invite``, ``leave``, ``ban``, ``knock``.
* A room without a join rules event has the join rule ``invite``.
* Rule x.2 ("validly signed by the homeserver of" the authorising user):
  checked for a signature *from that server* in ``signatures``; verifying
  it needs the server's keys, which is the signature layer's job
  (``roomstore.pdu.signatures``), not the auth rules'.  Checked whatever the
  membership (the spec's wording; Synapse checks it for joins only).
* Third-party invites (x.4.1.7): a signature in ``signed`` "matches" a
  public key when it verifies with it (ed25519, over ``signed`` without its
  ``signatures``), for any server and ``ed25519:`` key ID in ``signed``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any

from signedjson.key import decode_verify_key_bytes
from signedjson.sign import SignatureVerifyException, verify_signed_json

from roomstore.pdu.auth_common import AuthError, RoomState, server_of
from roomstore.pdu.parsing import ParsedPdu
from roomstore.pdu.signatures import decode_base64

__all__ = ["check_member_event"]


def _numbers(state: RoomState, top: int) -> Mapping[str, str]:
    """The rule number of each membership's rule in this room version."""
    version = state.room_version
    return _numbering(version.restricted_join_rule, version.knock_join_rule, top)


@functools.cache  # a handful of combinations, read by every member event
def _numbering(restricted: bool, knock: bool, top: int) -> Mapping[str, str]:
    shift = 1 if restricted else 0
    names = ("join", "invite", "leave", "ban", "knock")
    numbers = {name: f"{top}.{2 + shift + i}" for i, name in enumerate(names)}
    numbers["signed"] = f"{top}.2"
    kinds = len(names) if knock else len(names) - 1
    numbers["unknown"] = f"{top}.{2 + shift + kinds}"
    return types.MappingProxyType(numbers)


def check_member_event(state: RoomState, event: ParsedPdu, top: int) -> None:
    """Rule ``top`` (5 or 4): raise AuthError unless the membership change is allowed."""
    numbers = _numbers(state, top)
    if event.state_key is None or event.membership is None:
        raise AuthError(f"rule {top}.1: a member event needs a state_key and content.membership")
    if (
        state.room_version.restricted_join_rule
        and event.may_hold_key("join_authorised_via_users_server")
        and "join_authorised_via_users_server" in event.content
    ):
        authoriser = event.content["join_authorised_via_users_server"]
        signatures = event.event_dict.get("signatures")
        if not isinstance(authoriser, str) or server_of(authoriser) not in (signatures or {}):
            raise AuthError(
                f"rule {numbers['signed']}: not signed by the server of join_authorised_via_users_server {authoriser!r}"
            )
    membership, target = event.membership, event.state_key
    if membership == "join":
        _check_join(state, event, target, numbers["join"])
    elif membership == "invite":
        _check_invite(state, event, target, numbers["invite"])
    elif membership == "leave":
        _check_leave(state, event, target, numbers["leave"])
    elif membership == "ban":
        _check_ban(state, event, target, numbers["ban"])
    elif membership == "knock" and state.room_version.knock_join_rule:
        _check_knock(state, event, target, numbers["knock"])
    else:
        raise AuthError(f"rule {numbers['unknown']}: unknown membership {membership!r}")


def _check_join(state: RoomState, event: ParsedPdu, target: str, n: str) -> None:
    """``membership`` is ``join``."""
    version = state.room_version
    if (
        len(event.prev_event_ids) == 1
        and event.prev_event_ids[0] == state.create.event_id
        and target == state.creator()
    ):
        return  # n.1: the creator's first join
    if event.sender != target:
        raise AuthError(f"rule {n}.2: {event.sender} cannot join {target} to the room")
    current = state.membership(event.sender)
    if current == "ban":
        raise AuthError(f"rule {n}.3: {event.sender} is banned")
    rule = state.join_rule()
    if rule == "invite" or (rule == "knock" and version.knock_join_rule):
        if current in ("invite", "join"):
            return
        raise AuthError(f"rule {n}.4: join rule {rule!r} and {event.sender} is not invited")
    restricted = (rule == "restricted" and version.restricted_join_rule) or (
        rule == "knock_restricted" and version.knock_restricted_join_rule
    )
    if restricted:
        _check_restricted_join(state, event, f"{n}.5")
        return
    if rule == "public":
        return
    raise AuthError(f"rule {n}.7: join rule {rule!r} lets nobody join")


def _check_restricted_join(state: RoomState, event: ParsedPdu, n: str) -> None:
    """A join under the ``restricted`` or ``knock_restricted`` join rule."""
    if state.membership(event.sender) in ("join", "invite"):
        return
    authoriser = event.content.get("join_authorised_via_users_server")
    if not isinstance(authoriser, str):
        raise AuthError(f"rule {n}.2: a restricted join needs join_authorised_via_users_server")
    if state.membership(authoriser) != "join":
        raise AuthError(f"rule {n}.2: the authorising user {authoriser} is not joined")
    if state.level_of(authoriser) < state.named("invite"):
        raise AuthError(f"rule {n}.2: the authorising user {authoriser} may not invite")


def _check_invite(state: RoomState, event: ParsedPdu, target: str, n: str) -> None:
    """``membership`` is ``invite``."""
    if event.may_hold_key("third_party_invite") and "third_party_invite" in event.content:
        _check_third_party_invite(state, event, target, f"{n}.1")
        return
    if state.membership(event.sender) != "join":
        raise AuthError(f"rule {n}.2: {event.sender} is not joined")
    if state.membership(target) in ("join", "ban"):
        raise AuthError(f"rule {n}.3: {target} is {state.membership(target)}")
    if state.level_of(event.sender) < state.named("invite"):
        raise AuthError(f"rule {n}.5: {event.sender}'s power is below the invite level")


def _check_third_party_invite(state: RoomState, event: ParsedPdu, target: str, n: str) -> None:
    """An invite carrying ``third_party_invite`` (rule n = x.4.1)."""
    if state.membership(target) == "ban":
        raise AuthError(f"rule {n}.1: {target} is banned")
    invite = event.content["third_party_invite"]
    signed = invite.get("signed") if isinstance(invite, Mapping) else None
    if not isinstance(signed, Mapping):
        raise AuthError(f"rule {n}.2: third_party_invite has no signed object")
    if "mxid" not in signed or "token" not in signed:
        raise AuthError(f"rule {n}.3: third_party_invite.signed lacks mxid or token")
    if signed["mxid"] != target:
        raise AuthError(f"rule {n}.4: third_party_invite.signed.mxid is not the state_key")
    token = signed["token"]
    third_party = state.state.get(("m.room.third_party_invite", token)) if isinstance(token, str) else None
    if third_party is None:
        raise AuthError(f"rule {n}.5: no m.room.third_party_invite for token {token!r}")
    if third_party.sender != event.sender:
        raise AuthError(f"rule {n}.6: the sender did not send the m.room.third_party_invite")
    if not any(_verifies(signed, key) for key in _public_keys(third_party.content)):
        raise AuthError(f"rule {n}.8: no signature of third_party_invite.signed matches a public key")


def _public_keys(content: Mapping[str, Any]) -> Iterator[Any]:
    """The invite's public keys: ``public_key``, then each ``public_keys[].public_key``."""
    if "public_key" in content:
        yield content["public_key"]
    keys = content.get("public_keys")
    if isinstance(keys, list):
        for entry in keys:
            if isinstance(entry, Mapping) and "public_key" in entry:
                yield entry["public_key"]


def _verifies(signed: Mapping[str, Any], public_key: Any) -> bool:
    """Whether any ed25519 signature in ``signed`` verifies with ``public_key``
    (unpadded base64, standard or URL-safe)."""
    signatures = signed.get("signatures")
    if not isinstance(public_key, str) or not isinstance(signatures, Mapping):
        return False
    try:
        key_bytes = decode_base64(public_key)
    except ValueError:
        return False
    for server, by_key in signatures.items():
        if not isinstance(by_key, Mapping):
            continue
        for key_id in by_key:
            if not isinstance(key_id, str) or not key_id.startswith("ed25519:"):
                continue
            try:
                verify_signed_json(dict(signed), server, decode_verify_key_bytes(key_id, key_bytes))
                return True
            except (SignatureVerifyException, ValueError, TypeError, KeyError):
                continue
    return False


def _check_leave(state: RoomState, event: ParsedPdu, target: str, n: str) -> None:
    """``membership`` is ``leave``: leaving, rejecting an invite or knock, kicking, unbanning."""
    if event.sender == target:
        allowed = ("invite", "join", "knock") if state.room_version.knock_join_rule else ("invite", "join")
        if state.membership(target) in allowed:
            return
        raise AuthError(f"rule {n}.1: {target} is {state.membership(target) or 'not a member'} and cannot leave")
    if state.membership(event.sender) != "join":
        raise AuthError(f"rule {n}.2: {event.sender} is not joined")
    sender_level = state.level_of(event.sender)
    if state.membership(target) == "ban" and sender_level < state.named("ban"):
        raise AuthError(f"rule {n}.3: {event.sender}'s power is below the ban level to unban")
    if sender_level >= state.named("kick") and state.level_of(target) < sender_level:
        return
    raise AuthError(f"rule {n}.5: {event.sender} may not kick {target}")


def _check_ban(state: RoomState, event: ParsedPdu, target: str, n: str) -> None:
    """``membership`` is ``ban``."""
    if state.membership(event.sender) != "join":
        raise AuthError(f"rule {n}.1: {event.sender} is not joined")
    sender_level = state.level_of(event.sender)
    if sender_level >= state.named("ban") and state.level_of(target) < sender_level:
        return
    raise AuthError(f"rule {n}.3: {event.sender} may not ban {target}")


def _check_knock(state: RoomState, event: ParsedPdu, target: str, n: str) -> None:
    """``membership`` is ``knock`` (room versions 7+)."""
    rule = state.join_rule()
    if not (rule == "knock" or (rule == "knock_restricted" and state.room_version.knock_restricted_join_rule)):
        raise AuthError(f"rule {n}.1: join rule {rule!r} does not allow knocking")
    if event.sender != target:
        raise AuthError(f"rule {n}.2: {event.sender} cannot knock for {target}")
    if state.membership(event.sender) in ("ban", "invite", "join"):
        raise AuthError(f"rule {n}.4: {event.sender} is {state.membership(event.sender)} and cannot knock")
