'use strict';
// An in-process fake Drafter for the client's tests (no model): `handlers` answers the RPCs
// it names. Resolves to the server and its loopback address.

const grpc = require('@grpc/grpc-js');
const { loadService } = require('../index.js');

async function startFake(handlers) {
  const server = new grpc.Server();
  server.addService(loadService().service, handlers);
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
  );
  return { server, address: `127.0.0.1:${port}` };
}

module.exports = { startFake };
