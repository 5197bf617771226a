#!/usr/bin/env node
// Runs a wasm32-wasip1 test binary under Node's WASI preview1 (cargo's target runner).
// Usage: node wasi-runner.mjs module.wasm [args...]
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import process from "node:process";

const [file, ...args] = process.argv.slice(2);
const wasi = new WASI({ version: "preview1", args: [file, ...args], env: process.env, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(file));
// getImportObject came with Node 19.8 (and 18.17); older releases expose the imports directly.
const imports =
  typeof wasi.getImportObject === "function" ? wasi.getImportObject() : { wasi_snapshot_preview1: wasi.wasiImport };
const instance = await WebAssembly.instantiate(module, imports);
process.exitCode = wasi.start(instance);
