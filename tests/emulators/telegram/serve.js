// Serve telegram-test-api (an independent Telegram Bot API emulator) on 127.0.0.1 for the
// tests in tests/test_telegram_emulator.py: `node serve.js PORT`. Prints one "listening" line
// once it accepts connections, and stops on SIGTERM or when its stdin closes (so it never
// outlives the test process that started it).
'use strict';

const TelegramServer = require('telegram-test-api');

const port = Number(process.argv[2]);
if (!Number.isInteger(port) || port <= 0) {
  console.error('usage: node serve.js PORT (a free TCP port on 127.0.0.1)');
  process.exit(2);
}

// storeTimeout: the emulator forgets updates nobody fetched after this many seconds (60 by
// default); the real Bot API keeps them for 24 hours. An hour outlasts any test.
const server = new TelegramServer({ port, host: '127.0.0.1', storeTimeout: 3600 });

let stopping = false;
function stop() {
  if (stopping) return;
  stopping = true;
  server.stop().then(() => process.exit(0), () => process.exit(1));
}

server.start().then(
  () => console.log(`telegram-test-api listening on ${server.config.apiURL}`),
  (error) => {
    console.error(`telegram-test-api could not listen on 127.0.0.1:${port}: ${error}`);
    process.exit(1);
  },
);
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
process.stdin.on('end', stop);
process.stdin.on('error', stop);
process.stdin.resume();
