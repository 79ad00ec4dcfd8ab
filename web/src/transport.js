// The MQTT client around the agent (edge/service.py's part): connect with a last will, feed the agent one message
// at a time, publish what it returns (QoS 1), keep the subscriptions in step with the agent's, and reconnect with
// the protocol's jittered backoff (docs/protocol.md 1.1). mqtt.js over WebSockets in the browser, over TCP in node.

/** Protocol 1.1's device schedule: after an established connection is lost, a draw in the spread window; after the
 * n-th failed attempt, full jitter up to min(60 s, 2^n s); a successful connect starts over. */
export class Backoff {
  constructor(spreadS = 30, random = Math.random) {
    this.spreadS = spreadS;
    this.random = random;
    this.failures = 0;
  }

  connected() { this.failures = 0; }

  /** Seconds to wait before the next attempt; `lost`: an established connection was just lost. */
  next(lost) {
    if (lost) return this.random() * this.spreadS;
    this.failures += 1;
    return this.random() * Math.min(60, 2 ** this.failures);
  }
}

const NOT_AUTHORIZED = new Set([4, 5, 134, 135]); // CONNACK: bad user name or password, not authorized (3.1.1, 5)

/** Run `agent` against the broker at `url` until the run is finished, `stop()` is called, or the agent cannot go
 * on. Returns {stop, done}: done resolves with the reason the loop ended. */
export function runAgent(agent, mqtt, url, { username, password, spreadS = 30, log = agent.log, onChange = () => {} } = {}) {
  const me = agent.config.clientId;
  const offline = { topic: agent.topics.presence(me), payload: 'offline', qos: 1, retain: true };
  const options = {
    clientId: me, clean: false, protocolVersion: 4, reconnectPeriod: 0, connectTimeout: 15000, keepalive: 30,
    will: offline, username, password,
  };
  if (typeof WebSocket !== 'undefined') {
    // offer both: websockify in front of a broker's TCP listener takes "binary", Mosquitto's own listener "mqtt".
    // "binary" first: websockify 0.10 splits the offer at commas without trimming, so it finds only the first.
    // mqtt.js ends with close() and no code: the frame then carries none, and websockify 0.10 answers with the
    // reserved code 1005, which the browser reports as "a broken close frame". 1000 is a normal closure.
    options.createWebsocket = (wsUrl) => {
      const socket = new WebSocket(wsUrl, ['binary', 'mqtt']);
      const close = socket.close.bind(socket);
      socket.close = (code = 1000, reason) => close(code, reason);
      return socket;
    };
  }
  const backoff = new Backoff(spreadS);
  let subscribed = new Set(), queue = Promise.resolve(), stopped = false, timer = null, wasConnected = false;
  let finish;
  const done = new Promise((resolve) => { finish = resolve; });
  const client = mqtt.connect(url, options);

  const publish = (messages) => Promise.all(messages.map((m) => client.publishAsync(m.topic, m.payload, { qos: 1, retain: m.retain })));
  const follow = async () => {
    const wanted = new Set(agent.subscriptions());
    const drop = [...subscribed].filter((t) => !wanted.has(t)), add = [...wanted].filter((t) => !subscribed.has(t));
    subscribed = wanted;
    if (drop.length) await client.unsubscribeAsync(drop);
    if (add.length) await client.subscribeAsync(Object.fromEntries(add.map((topic) => [topic, { qos: 1 }])));
  };
  const end = async (reason) => {
    if (stopped) return;
    stopped = true;
    clearTimeout(timer);
    if (client.connected) await client.publishAsync(offline.topic, offline.payload, { qos: 1, retain: true }).catch(() => {});
    await client.endAsync().catch(() => {});
    finish(reason);
  };
  const run = (work) => {
    queue = queue.then(work).then(() => onChange()).catch((e) => {
      log(`stopping: ${e.message}`);
      end(e.message);
    });
    return queue;
  };

  client.on('connect', () => {
    backoff.connected();
    wasConnected = true;
    run(async () => {
      // a persistent session keeps the last run's subscriptions: every model topic goes unless wanted now
      subscribed = new Set([agent.topics.allModels]);
      await follow();
      await publish(await agent.connected());
    });
  });
  client.on('message', (topic, payload) => {
    run(async () => {
      if (stopped) return;
      await publish(await agent.handle(topic, new Uint8Array(payload.buffer, payload.byteOffset, payload.byteLength)));
      await follow();
      if (agent.finalAccuracy !== null) await end('finished');
    });
  });
  client.on('error', (e) => {
    if (NOT_AUTHORIZED.has(e.code)) {
      log(`the broker refused this device: ${e.message}`);
      end('refused');
    }
  });
  client.on('close', () => {
    if (stopped) return;
    const wait = backoff.next(wasConnected);
    if (wasConnected) log(`lost the broker: reconnecting in ${wait.toFixed(1)} s`);
    wasConnected = false;
    clearTimeout(timer);
    timer = setTimeout(() => { if (!stopped) client.reconnect(); }, wait * 1000);
  });
  return { stop: () => end('stopped'), done, client };
}
