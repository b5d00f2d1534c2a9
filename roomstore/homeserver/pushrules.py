"""``GET /pushrules/``: the spec's default push rules (client-server API,
"Predefined Rules"), the same for every user: this server keeps no rules of
its own. Clients wait for this answer before they show a room list."""

from __future__ import annotations

from roomstore.homeserver.http import ClientRequest, Router

__all__ = ["PushRules", "default_rules"]

_NOTIFY_SOUND = ["notify", {"set_tweak": "sound", "value": "default"}]
_HIGHLIGHT = {"set_tweak": "highlight"}


def _rule(rule_id: str, conditions: list, actions: list, enabled: bool = True) -> dict:
    return {"rule_id": rule_id, "default": True, "enabled": enabled, "conditions": conditions, "actions": actions}


def _event_match(key: str, pattern: str) -> dict:
    return {"kind": "event_match", "key": key, "pattern": pattern}


def _exact(key: str, value) -> dict:
    return {"kind": "event_property_is", "key": key, "value": value}


def default_rules(user_id: str) -> dict:
    """The predefined rules, in the spec's order, for ``user_id``."""
    localpart = user_id[1:].partition(":")[0]
    override = [
        _rule(".m.rule.master", [], [], enabled=False),
        _rule(".m.rule.suppress_notices", [_event_match("content.msgtype", "m.notice")], []),
        _rule(
            ".m.rule.invite_for_me",
            [
                _event_match("type", "m.room.member"),
                _event_match("content.membership", "invite"),
                _event_match("state_key", user_id),
            ],
            ["notify", {"set_tweak": "sound", "value": "default"}],
        ),
        _rule(".m.rule.member_event", [_event_match("type", "m.room.member")], []),
        _rule(
            ".m.rule.is_user_mention",
            [{"kind": "event_property_contains", "key": "content.m\\.mentions.user_ids", "value": user_id}],
            [*_NOTIFY_SOUND, _HIGHLIGHT],
        ),
        _rule(".m.rule.contains_display_name", [{"kind": "contains_display_name"}], [*_NOTIFY_SOUND, _HIGHLIGHT]),
        _rule(
            ".m.rule.is_room_mention",
            [_exact("content.m\\.mentions.room", True), {"kind": "sender_notification_permission", "key": "room"}],
            ["notify", _HIGHLIGHT],
        ),
        _rule(
            ".m.rule.roomnotif",
            [{"kind": "sender_notification_permission", "key": "room"}, _event_match("content.body", "@room")],
            ["notify", _HIGHLIGHT],
        ),
        _rule(
            ".m.rule.tombstone",
            [_event_match("type", "m.room.tombstone"), _event_match("state_key", "")],
            ["notify", _HIGHLIGHT],
        ),
        _rule(".m.rule.reaction", [_event_match("type", "m.reaction")], []),
        _rule(
            ".m.rule.room.server_acl", [_event_match("type", "m.room.server_acl"), _event_match("state_key", "")], []
        ),
        _rule(".m.rule.suppress_edits", [_exact("content.m\\.relates_to.rel_type", "m.replace")], []),
    ]
    content = [
        {**_rule(".m.rule.contains_user_name", [], [*_NOTIFY_SOUND, _HIGHLIGHT]), "pattern": localpart},
    ]
    underride = [
        _rule(
            ".m.rule.call", [_event_match("type", "m.call.invite")], ["notify", {"set_tweak": "sound", "value": "ring"}]
        ),
        _rule(
            ".m.rule.encrypted_room_one_to_one",
            [{"kind": "room_member_count", "is": "2"}, _event_match("type", "m.room.encrypted")],
            _NOTIFY_SOUND,
        ),
        _rule(
            ".m.rule.room_one_to_one",
            [{"kind": "room_member_count", "is": "2"}, _event_match("type", "m.room.message")],
            _NOTIFY_SOUND,
        ),
        _rule(".m.rule.message", [_event_match("type", "m.room.message")], ["notify"]),
        _rule(".m.rule.encrypted", [_event_match("type", "m.room.encrypted")], ["notify"]),
    ]
    return {"override": override, "content": content, "room": [], "sender": [], "underride": underride}


class PushRules:
    def register_routes(self, router: Router) -> None:
        router.add("GET", "/pushrules", self.all_rules)  # and "/pushrules/": a route takes a trailing slash
        router.add("GET", "/pushrules/global", self.global_rules)

    async def all_rules(self, request: ClientRequest) -> dict:
        return {"global": default_rules(request.user.user_id)}

    async def global_rules(self, request: ClientRequest) -> dict:
        return default_rules(request.user.user_id)
