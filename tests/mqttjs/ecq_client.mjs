// One MQTT.js client session for tests/test_transports.py and tests/test_mqtt5_clients.py, driven by a JSON spec on
// stdin; prints one JSON result on stdout and exits 0 (1 on an error, with what it got so far and "error").
//
// spec: {url: "mqtt://|mqtts://|ws://|wss://127.0.0.1:PORT", clientId, username?, password?, ca? (PEM path),
//        protocolVersion?: 4 (MQTT 3.1.1, the default) or 5,
//        publish?: [[topic, payload], ...]   sent pipelined at QoS 1, then every PUBACK awaited,
//        subscribe?: "filter"                 at QoS 1 after the publishes,
//        expect?: N                           messages to wait for after subscribing,
//        quietMs?: ms                         then wait this long for anything more,
//        timeoutMs: ms                        the whole session's bound}
// result: {acked: N, granted: [qos], received: [[topic, payload], ...],
//          acks: [[reason code, Reason String or null], ...]   each publish's PUBACK, in the order of publish (MQTT 5:
//                                                          MQTT.js reports a code >= 0x80 as an error carrying it),
//          userProperties: [{name: value}, ...]            each received message's, in the order of received}
// MQTT.js acknowledges each QoS 1 message it receives; end() sends DISCONNECT after those PUBACKs.
import fs from "node:fs";
import mqtt from "mqtt";

const spec = JSON.parse(fs.readFileSync(0, "utf8"));
const result = { acked: 0, granted: [], received: [], acks: [], userProperties: [] };
let client;

const finish = (code, error) => {
  if (error) result.error = String(error);
  process.stdout.write(JSON.stringify(result) + "\n", () => process.exit(code));
};
setTimeout(() => finish(1, `timed out after ${spec.timeoutMs} ms`), spec.timeoutMs).unref();

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

try {
  client = await mqtt.connectAsync(spec.url, {
    clientId: spec.clientId,
    username: spec.username,
    password: spec.password,
    ca: spec.ca ? fs.readFileSync(spec.ca) : undefined,
    protocolVersion: spec.protocolVersion ?? 4,
    clean: true,
    reconnectPeriod: 0,
    connectTimeout: spec.timeoutMs,
  });
  let arrived = () => {};
  client.on("message", (topic, payload, packet) => {
    result.received.push([topic, payload.toString()]);
    result.userProperties.push(packet.properties?.userProperties ?? {});
    arrived();
  });
  result.acks = await Promise.all((spec.publish ?? []).map(([topic, payload]) => new Promise((resolve, reject) => {
    client.publish(topic, payload, { qos: 1 }, (error, packet) => {
      if (error && typeof error.code !== "number") return reject(error);  // no PUBACK: the session failed
      if (!error) result.acked += 1;
      resolve([error?.code ?? 0, packet?.properties?.reasonString ?? null]);
    });
  })));
  if (spec.subscribe) {
    const grants = await client.subscribeAsync(spec.subscribe, { qos: 1 });
    result.granted = grants.map((grant) => grant.qos);
    await new Promise((resolve) => {
      arrived = () => { if (result.received.length >= (spec.expect ?? 0)) resolve(); };
      arrived();
    });
    await sleep(spec.quietMs ?? 0);
  }
  await client.endAsync();
  finish(0);
} catch (error) {
  client?.end(true);
  finish(1, error?.message ?? error);
}
