// The server extension's API (mlxcache_kernel/panel/handlers.py) and what the notebook's
// kernel runs for "restore into this notebook" (mlxcache_kernel/panel/restore.py).

import { URLExt } from '@jupyterlab/coreutils';
import { Kernel, ServerConnection } from '@jupyterlab/services';

export interface Writer {
  owner: string;
  pid: number;
  host: string;
  time: number;
  alive: boolean;
}

export interface NameRecord {
  name: string;
  namespace: string;
  key: string;
  tokens: number;
  model: string | null;
  session: string | null;
  preview: string | null;
  held_by: number | null;
}

export interface FileRow {
  namespace: string;
  key: string;
  tokens: number;
  bytes: number;
  kv_bytes: number;
  created: number;
  last_used: number;
  pinned_by: string[];
  leases: number;
  writer: Writer | null;
  kind: 'prefix' | 'object';
  in_ram: { owner: string; pid: number; write_state: string; hits: number }[];
  sessions: string[];
  names: NameRecord[];
  preview: string | null;
}

export interface ProcessRow {
  owner: string;
  pid: number | null;
  host: string | null;
  started: number | null;
  alive: boolean;
  heartbeat_age_s: number | null;
  pending_writes?: number;
  pending_bytes?: number;
  in_catalogue: boolean;
  writing: number;
  reading: number;
  resume_records: number;
  files: number;
  bytes: number;
  report: {
    time: number;
    models: { name: string; namespace: string }[];
    sessions: string[];
    ram: { used_bytes: number; budget_bytes: number | null; entries: number };
    writes: { pending: number; dirty: number; failed: number; error: string | null };
    ssd_budget_bytes: number | null;
    late_reason: string | null;
    remote: { url: string; state: string; last_error: string | null } | null;
  } | null;
}

export interface ModelGroup {
  group: string;
  kind: 'prefix' | 'object';
  names: string[];
  files: number;
  tokens: number;
  bytes: number;
  pinned: number;
  last_used: number;
}

export interface Overview {
  state: 'ok' | 'missing' | 'foreign' | 'unreadable' | 'empty' | 'corrupt' | 'busy' | 'error';
  message: string | null;
  warnings?: string[];
  retry_s?: number;
  cache_dir?: string;
  time?: number;
  ssd?: {
    bytes?: number;
    files?: number;
    blocks?: number;
    caps?: number[];
    quarantine_files: number;
    quarantine_bytes: number;
    set_aside_catalogues: string[];
  };
  processes?: ProcessRow[];
  models?: ModelGroup[];
  names?: NameRecord[];
  page?: (PageQuery & { matching: number; files: FileRow[] }) | null;
  kernels?: { [pid: string]: { kernel_id: string; name: string; path: string | null } };
}

export interface PageQuery {
  group: string | null;
  sort: string;
  descending: boolean;
  query: string;
  pinned: string;
  offset: number;
  limit: number;
}

export interface Answer {
  ok: boolean;
  message: string;
}

const settings = () => ServerConnection.makeSettings();

async function call(path: string, init: RequestInit = {}): Promise<any> {
  const s = settings();
  const url = URLExt.join(s.baseUrl, 'mlxcache/api', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, s);
  } catch (e) {
    return { state: 'error', ok: false, message: `the Jupyter server did not answer: ${e}` };
  }
  try {
    return await response.json();
  } catch {
    const hint = response.status === 404 ? ' (is the mlxcache_kernel server extension enabled?)' : '';
    return { state: 'error', ok: false, message: `the server answered ${response.status}${hint}` };
  }
}

export function fetchOverview(q: PageQuery): Promise<Overview> {
  const params = new URLSearchParams({
    group: q.group ?? '',
    sort: q.sort,
    desc: q.descending ? '1' : '0',
    q: q.query,
    pinned: q.pinned,
    offset: String(q.offset),
    limit: String(q.limit)
  });
  return call(`overview?${params}`);
}

export function act(action: 'pin' | 'unpin' | 'delete', body: object): Promise<Answer> {
  return call(action, { method: 'POST', body: JSON.stringify(body) });
}

const NAME = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$/; // engine/named/names.py

export function validName(name: string): boolean {
  return NAME.test(name);
}

/** Ask `kernel` to restore the named checkpoint (a silent execution; the answer is JSON). */
export async function restoreInKernel(kernel: Kernel.IKernelConnection, name: string): Promise<Answer> {
  if (!validName(name)) {
    return { ok: false, message: `invalid checkpoint name ${JSON.stringify(name)}` };
  }
  const expr = `__import__('mlxcache_kernel.panel.restore', fromlist=['restore']).restore(${JSON.stringify(name)})`;
  const future = kernel.requestExecute({
    code: '',
    silent: true,
    store_history: false,
    user_expressions: { mlxcache: expr }
  });
  const reply = await future.done;
  const content: any = reply.content;
  const result = content.user_expressions?.mlxcache;
  if (content.status !== 'ok' || !result) {
    return { ok: false, message: `the kernel did not run the restore (${content.status})` };
  }
  if (result.status !== 'ok') {
    const why = result.ename === 'ModuleNotFoundError' ? "this notebook's kernel has no mlxcache_kernel" : `${result.ename}: ${result.evalue}`;
    return { ok: false, message: why };
  }
  try {
    return JSON.parse(result.data['text/plain']);
  } catch {
    return { ok: false, message: `unexpected answer from the kernel: ${result.data['text/plain']}` };
  }
}
