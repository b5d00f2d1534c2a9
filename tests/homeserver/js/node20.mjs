// matrix-js-sdk 43 declares Node >= 22; Debian's Node is 20. The one Node 22 API the SDK (and its
// dependencies) call is Promise.withResolvers (ES2024); this gives Node 20 the standard's behaviour.
// Imported by scenario.mjs before the SDK, so the SDK's modules see it.
if (typeof Promise.withResolvers !== "function") {
    Promise.withResolvers = function withResolvers() {
        let resolve, reject;
        const promise = new this((res, rej) => { resolve = res; reject = rej; });
        return { promise, resolve, reject };
    };
}
