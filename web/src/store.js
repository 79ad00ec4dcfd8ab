// What the page keeps across reloads, by key (the agent's state directory, edge/state.py, in the browser):
//   device   the last completed round: its head (device-local tensors), its update, round, n_samples, metrics
//   images   the user's images at the model's input size, with their class and file name
//   split    the fixed train/test split of those images, with their fingerprint
//   final    after the last round: the served model's accuracy and loss, and its tensors
//   identity the device id this browser uses, unless the URL gives one
// IndexedDB stores typed arrays as they are (structured clone) and writes a record atomically.

const DB_NAME = 'fedper';
const STORE = 'state';

export class IndexedDBStore {
  constructor(db) {
    this.db = db;
  }

  /** The page's database (created on first use); `name` keeps two devices in one browser apart. */
  static open(indexedDB, name = DB_NAME) {
    return new Promise((resolve, reject) => {
      const request = indexedDB.open(name, 1);
      request.onupgradeneeded = () => request.result.createObjectStore(STORE);
      request.onsuccess = () => resolve(new IndexedDBStore(request.result));
      request.onerror = () => reject(request.error);
    });
  }

  get(key) {
    return this.request('readonly', (s) => s.get(key));
  }

  put(key, value) {
    return this.request('readwrite', (s) => s.put(value, key));
  }

  delete(key) {
    return this.request('readwrite', (s) => s.delete(key));
  }

  request(mode, make) {
    return new Promise((resolve, reject) => {
      const tx = this.db.transaction(STORE, mode);
      const request = make(tx.objectStore(STORE));
      tx.oncomplete = () => resolve(request.result);
      tx.onerror = () => reject(tx.error);
      tx.onabort = () => reject(tx.error ?? new Error('IndexedDB transaction aborted (quota?)'));
    });
  }
}

/** The same interface in memory, with structuredClone as IndexedDB copies values: for node, which has no
 * IndexedDB (the browser test runs the real one, across a reload). */
export class MemoryStore {
  constructor() {
    this.values = new Map();
  }

  async get(key) {
    return this.values.has(key) ? structuredClone(this.values.get(key)) : undefined;
  }

  async put(key, value) {
    this.values.set(key, structuredClone(value));
  }

  async delete(key) {
    this.values.delete(key);
  }
}
