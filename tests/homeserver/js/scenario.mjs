// The issue 41 scenario driven by matrix-js-sdk, a real Matrix client, against a running
// `roomstore homeserver`: `node scenario.mjs BASE_URL SERVER_NAME`. Prints one JSON line per step;
// exits 1 on the first step that fails (its line says why). Run by tests/homeserver/test_clients.py.
//
// Which parts of the SDK: its real client (`createClient`) throughout. Bob's devices run the SDK's own
// sync loop (`startClient`), as an app does: it asks for /versions, /pushrules/, a filter
// (/user/{id}/filter) and /capabilities before its first /sync, keeps long-polling, and builds the
// rooms, timelines and pagination tokens the checks read. Sending, redacting, /state, /messages and
// leaving are the client's request methods (sendEvent, redactEvent, roomState, createMessagesRequest,
// leave), the same calls an app's UI makes. Alice syncs too, so her client matches the remote echo of
// each message she sends to its local echo (once each, none left pending). Every request and its status is recorded through
// the client's `fetchFn` (the SDK's own hook for the HTTP layer), so a check can say what the
// server answered, and a failing one names the requests that did not succeed.

import "./node20.mjs"; // before the SDK: see there
import { ClientEvent, Direction, EventTimeline, Method, RoomEvent, createClient } from "matrix-js-sdk";

// Some SDK modules log through their own module-level logger to console.log/info/debug: to stderr with
// them, so stdout holds the step lines alone.
for (const level of ["log", "info", "debug"]) console[level] = (...args) => console.error(...args);

/** The SDK's logger for our clients: warnings and errors to stderr, the rest (a line per request) dropped. */
const quietLogger = {
    trace() {}, debug() {}, info() {},
    warn: (...args) => console.error("js-sdk warn:", ...args),
    error: (...args) => console.error("js-sdk error:", ...args),
    getChild() { return quietLogger; },
};

class StepFailed extends Error {}

function check(condition, what) {
    if (!condition) throw new StepFailed(what);
}

function step(name, facts = {}) {
    process.stdout.write(JSON.stringify({ step: name, ...facts }) + "\n");
}

/** A fetch that records (method, path, status) and keeps each /sync answer's JSON. */
function recordingFetch(log) {
    return async (input, init = {}) => {
        const url = new URL(input instanceof Request ? input.url : String(input));
        const response = await fetch(input, init);
        const entry = { method: init.method ?? "GET", path: url.pathname, query: url.search, status: response.status };
        if (url.pathname.endsWith("/sync") && response.ok) entry.body = await response.clone().json();
        log.push(entry);
        return response;
    };
}

async function register(base, name) {
    const client = createClient({ baseUrl: base, logger: quietLogger });
    const answer = await client.registerRequest({
        username: name, password: "a password", auth: { type: "m.login.dummy" },
        initial_device_display_name: `${name}'s js-sdk`,
    });
    check(answer.access_token && answer.user_id, `register ${name}: ${JSON.stringify(answer)}`);
    return answer;
}

/** A client for a session; `log` (optional) records its requests. */
function sessionClient(base, session, log) {
    return createClient({
        baseUrl: base, accessToken: session.access_token, userId: session.user_id, deviceId: session.device_id,
        fetchFn: log ? recordingFetch(log) : undefined, timelineSupport: true, logger: quietLogger,
    });
}

/** Start the SDK's sync loop and wait until it is prepared (its first sync done). */
async function startSyncing(client, opts) {
    const prepared = new Promise((resolve, reject) => {
        const onSync = (state, _previous, data) => {
            if (state === "PREPARED") {
                client.off(ClientEvent.Sync, onSync);
                resolve();
            } else if (state === "ERROR") {
                client.off(ClientEvent.Sync, onSync);
                reject(new StepFailed(`sync loop failed: ${data?.error ?? state}`));
            }
        };
        client.on(ClientEvent.Sync, onSync);
    });
    await client.startClient({ pollTimeout: 30000, ...opts });
    await withTimeout(prepared, 30000, "the sync loop was not prepared in 30 s");
}

async function withTimeout(promise, ms, what) {
    let timer;
    const timeout = new Promise((_, reject) => { timer = setTimeout(() => reject(new StepFailed(what)), ms); });
    try {
        return await Promise.race([promise, timeout]);
    } finally {
        clearTimeout(timer);
    }
}

/** Resolves when `predicate()` holds, checked on each of the client's syncs. */
function untilSynced(client, predicate, ms, what) {
    return withTimeout(new Promise((resolve) => {
        if (predicate()) return resolve();
        const onSync = () => {
            if (predicate()) {
                client.off(ClientEvent.Sync, onSync);
                resolve();
            }
        };
        client.on(ClientEvent.Sync, onSync);
    }), ms, what);
}

/** Requests that failed, but for unstable (MSC) endpoints this server does not have: their 404 is the
 * spec's answer to an unknown endpoint, and the SDK expects it. */
function failures(log) {
    return log.filter((entry) => entry.status >= 400 && !(entry.status === 404 && entry.path.includes("/unstable/")))
        .map((e) => `${e.method} ${e.path} ${e.status}`);
}

/** The start-up requests before the first /sync, which must all have succeeded. */
function checkStartUp(log, userId) {
    const firstSync = log.findIndex((entry) => entry.path.endsWith("/sync"));
    check(firstSync > 0, "no /sync request");
    const before = log.slice(0, firstSync);
    const asked = (suffix, method = "GET") =>
        before.find((entry) => entry.method === method && entry.path.endsWith(suffix));
    const wanted = [["/pushrules/"], [`/user/${encodeURIComponent(userId)}/filter`, "POST"], ["/capabilities"]];
    for (const [suffix, method] of wanted) {
        const entry = asked(suffix, method);
        check(entry, `no ${method ?? "GET"} ${suffix} before the first /sync`);
        check(entry.status === 200, `${entry.method} ${entry.path} answered ${entry.status}`);
    }
    return before.map((entry) => `${entry.method} ${entry.path} ${entry.status}`);
}

function roomMessageIds(events) {
    return events.filter((e) => e.getType() === "m.room.message").map((e) => e.getId());
}

async function scenario(base, serverName) {
    const aliceSession = await register(base, "alice");
    const bobSession = await register(base, "bob");
    const aliceLog = [];
    const alice = sessionClient(base, aliceSession, aliceLog);
    const whoami = await alice.whoami();
    check(whoami.user_id === aliceSession.user_id, `whoami: ${JSON.stringify(whoami)}`);
    const bobLog = [];
    const bob = sessionClient(base, bobSession, bobLog);
    const clients = [alice, bob];
    try {
        const { room_id: roomId } = await alice.createRoom({
            name: "Tea", topic: "leaves", invite: [`@bob:${serverName}`], preset: "private_chat",
        });
        step("createRoom", { room_id: roomId });
        await startSyncing(alice, { initialSyncLimit: 20, pendingEventOrdering: "detached" });

        await startSyncing(bob, { initialSyncLimit: 20 });
        const startUp = checkStartUp(bobLog, bobSession.user_id);
        const invited = bob.getRoom(roomId);
        check(invited?.getMyMembership() === "invite", `bob's room after the initial sync: ${invited?.getMyMembership()}`);
        check(invited.name === "Tea", `the invite's room name: ${invited.name}`);
        check(invited.getDMInviter() === aliceSession.user_id || invited.getMember(bobSession.user_id)?.events.member
            ?.getSender() === aliceSession.user_id, "the invite does not name alice as its sender");
        step("invite seen in initial sync", { start_up: startUp });

        await bob.joinRoom(roomId);
        await untilSynced(bob, () => bob.getRoom(roomId)?.getMyMembership() === "join", 10000,
            "bob's sync loop never saw his join");
        const members = bob.getRoom(roomId).getJoinedMembers().map((m) => m.userId).sort();
        check(JSON.stringify(members) === JSON.stringify([aliceSession.user_id, bobSession.user_id].sort()),
            `joined members: ${members}`);
        step("join");

        const sent = [];
        for (let i = 0; i < 100; i++) {
            const answer = await alice.sendEvent(roomId, "m.room.message", { msgtype: "m.text", body: `m${i}` },
                `txn-${i}`);
            sent.push(answer.event_id);
        }
        // A retry is the same request again (the SDK's HTTP layer repeats it as it stands after a lost answer).
        const retried = await alice.http.authedRequest(Method.Put,
            `/rooms/${encodeURIComponent(roomId)}/send/m.room.message/txn-7`, undefined,
            { msgtype: "m.text", body: "again" });
        check(retried.event_id === sent[7], "a retried txnId made a new event");
        // Alice's own sync loop matched the remote echo of each message to its local echo: once each, none
        // pending, by the `unsigned.transaction_id` the server gives the sending device.
        const aliceRoom = alice.getRoom(roomId);
        const echoes = () => roomMessageIds(aliceRoom.getLiveTimeline().getEvents());
        await untilSynced(alice, () => echoes().includes(sent[99]), 10000, "alice's sync loop never saw her messages");
        const mine = echoes().filter((id) => !id.startsWith("~"));
        check(aliceRoom.getPendingEvents().length === 0, `alice has ${aliceRoom.getPendingEvents().length} pending events`);
        check(JSON.stringify(mine) === JSON.stringify(sent.slice(sent.length - mine.length)),
            `alice's timeline holds her messages out of order or twice (${mine.length})`);
        const echoed = aliceLog.filter((e) => e.body).flatMap((e) => e.body.rooms.join[roomId]?.timeline.events ?? [])
            .filter((e) => sent.includes(e.event_id));
        const withoutTxn = echoed.filter((e) => e.unsigned?.transaction_id !== `txn-${sent.indexOf(e.event_id)}`);
        check(echoed.length > 0 && withoutTxn.length === 0,
            `${withoutTxn.length} of the ${echoed.length} remote echoes alice synced lack her transaction_id`);
        step("100 messages sent; a retried txnId returned the same event");

        const redaction = await alice.redactEvent(roomId, sent[50], "redact-1", { reason: "typo" });
        check(Boolean(redaction.event_id), `redact: ${JSON.stringify(redaction)}`);
        await untilSynced(bob, () => bob.getRoom(roomId)?.findEventById(sent[50])?.isRedacted(), 10000,
            "bob's client never saw the message redacted");
        step("redaction");

        // A second device of bob's starts fresh: its initial sync is limited to 10 events and paginates back.
        const fresh = await bob.loginRequest({
            type: "m.login.password", identifier: { type: "m.id.user", user: "bob" }, password: "a password",
        });
        const secondLog = [];
        const second = sessionClient(base, fresh, secondLog);
        clients.push(second);
        await startSyncing(second, { initialSyncLimit: 10 });
        const initial = secondLog.find((entry) => entry.path.endsWith("/sync")).body.rooms.join[roomId].timeline;
        check(initial.limited === true && typeof initial.prev_batch === "string",
            `the initial sync's timeline: limited=${initial.limited} prev_batch=${initial.prev_batch}`);
        check(initial.events.length === 10, `the initial sync's timeline has ${initial.events.length} events`);
        const timeline = second.getRoom(roomId).getLiveTimeline();
        const newest = roomMessageIds(timeline.getEvents()).reverse();
        check(timeline.getPaginationToken(EventTimeline.BACKWARDS) === initial.prev_batch, "the SDK lost prev_batch");
        let pages = 0;
        while (await second.paginateEventTimeline(timeline, { backwards: true, limit: 30 })) {
            check(++pages < 50, "back-pagination does not end");
        }
        const everything = roomMessageIds(timeline.getEvents()).reverse();
        check(JSON.stringify(everything) === JSON.stringify([...sent].reverse()),
            `not every message, newest first: ${everything.length} of ${sent.length}`);
        check(timeline.getEvents()[0].getType() === "m.room.create", "pagination did not reach the create event");
        check(second.getRoom(roomId).findEventById(sent[50]).isRedacted(), "the redacted message is not redacted");
        step("limited sync and back-pagination", { messages: everything.length, newest: newest.length, pages });

        // Bob's first device is long-polling; a send wakes it.
        await new Promise((resolve) => setTimeout(resolve, 300));
        const woken = new Promise((resolve) => {
            const onTimeline = (event, room) => {
                if (room?.roomId === roomId && event.getContent().body === "late") {
                    bob.off(RoomEvent.Timeline, onTimeline);
                    resolve(event);
                }
            };
            bob.on(RoomEvent.Timeline, onTimeline);
        });
        const started = performance.now();
        const late = await alice.sendEvent(roomId, "m.room.message", { msgtype: "m.text", body: "late" }, "late");
        const seen = await withTimeout(woken, 5000, "bob's long-poll was not woken by the send within 5 s");
        const elapsed = (performance.now() - started) / 1000;
        check(seen.getId() === late.event_id, "bob saw another event");
        check(elapsed < 1.0, `the incremental sync took ${elapsed.toFixed(2)} s after the send`);
        const longPoll = bobLog.filter((e) => e.path.endsWith("/sync") && /timeout=30000/.test(e.query));
        check(longPoll.length > 0, "bob's sync loop never long-polled");
        step("incremental sync woken by a send", { seconds: Math.round(elapsed * 1000) / 1000 });

        const state = await bob.roomState(roomId);
        const names = state.filter((e) => e.type === "m.room.name");
        check(names.length === 1 && names[0].content.name === "Tea", `/state: ${JSON.stringify(names)}`);
        const topic = await bob.getStateEvent(roomId, "m.room.topic", "");
        check(topic.topic === "leaves", `/state/m.room.topic: ${JSON.stringify(topic)}`);
        const sdkTopic = bob.getRoom(roomId).currentState.getStateEvents("m.room.topic", "")?.getContent();
        check(sdkTopic?.topic === "leaves", "the sync loop's room state has no topic");
        step("/state");

        await bob.leave(roomId);
        await untilSynced(bob, () => bob.getRoom(roomId)?.getMyMembership() === "leave", 10000,
            "bob's sync loop never saw his leave");
        const after = await alice.sendEvent(roomId, "m.room.message", { msgtype: "m.text", body: "bob is gone" },
            "after-leave");
        await new Promise((resolve) => setTimeout(resolve, 500)); // a sync that would carry it, had bob stayed
        check(!bob.getRoom(roomId).findEventById(after.event_id), "bob's client got a message sent after he left");
        const page = await bob.createMessagesRequest(roomId, bob.store.getSyncToken(), 20, Direction.Backward);
        const pageIds = page.chunk.map((e) => e.event_id);
        check(!pageIds.includes(after.event_id), "bob sees a message sent after he left");
        check(pageIds.includes(late.event_id), "bob lost what he saw before he left");
        step("leave, and what the leaver sees");

        const failed = failures([...aliceLog, ...bobLog, ...secondLog]);
        check(failed.length === 0, `requests that failed: ${failed.join(", ")}`);
        step("every request the SDK made succeeded", { requests: aliceLog.length + bobLog.length + secondLog.length });
    } finally {
        for (const client of clients) client.stopClient();
    }
}

try {
    await scenario(process.argv[2], process.argv[3]);
    process.exit(0);
} catch (error) {
    const why = error instanceof StepFailed ? error.message : `${error.name}: ${error.message} ${error.stack ?? ""}`;
    process.stdout.write(JSON.stringify({ failed: why }) + "\n");
    process.exit(1);
}
