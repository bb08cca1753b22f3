// The "MLX Cache" side panel: every kernel's cache on the shared directory, refreshed every
// REFRESH_MS while the panel is visible (never while hidden), with pin / unpin / delete
// through the server extension and "restore into this notebook" through the notebook's kernel.

import { Dialog, InputDialog, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { act, Answer, FileRow, fetchOverview, ModelGroup, Overview, PageQuery, ProcessRow, restoreInKernel, validName } from './api';
import { ago, bytes, esc, short, since } from './format';

export const REFRESH_MS = 3000;
const SORTS: [string, string][] = [
  ['last_used', 'last used'], ['tokens', 'tokens'], ['bytes', 'bytes on SSD'], ['pinned', 'pinned'],
  ['writer', 'writer pid'], ['created', 'written']
];
const STATES: { [s: string]: string } = {
  ok: 'ok', missing: 'no cache directory yet', foreign: "another user's directory", unreadable: 'unreadable',
  empty: 'no SSD tier yet', corrupt: 'catalogue damaged', busy: 'catalogue busy', error: 'error'
};

export class CachePanel extends Widget {
  private readonly tracker: INotebookTracker;
  private timer: number | null = null;
  private inFlight = false;
  private requests = 0;
  private last: Overview | null = null;
  private readonly query: PageQuery = { group: null, sort: 'last_used', descending: true, query: '', pinned: 'all', offset: 0, limit: 50 };
  private readonly body: HTMLElement;
  private readonly status: HTMLElement;
  private readonly filter: HTMLInputElement;
  private readonly pinnedSelect: HTMLSelectElement;

  constructor(tracker: INotebookTracker) {
    super();
    this.tracker = tracker;
    this.id = 'mlxcache-panel';
    this.addClass('mlxc-p');
    this.title.caption = 'MLX Cache: every kernel\'s prompt cache on this machine';
    this.node.innerHTML = `
      <div class="mlxc-p-head"><b>MLX Cache</b> <span class="mlxc-p-state"></span>
        <button class="mlxc-p-refresh" title="refresh now">⟳</button></div>
      <div class="mlxc-p-status" aria-live="polite"></div>
      <div class="mlxc-p-body"></div>
      <div class="mlxc-p-tools">
        <input class="mlxc-p-filter" type="search" placeholder="filter: key, pin name, writer pid or host">
        <select class="mlxc-p-pinned" title="which checkpoints"><option value="all">all</option><option value="pinned">pinned</option>
          <option value="unpinned">unpinned</option></select>
      </div>
      <div class="mlxc-p-tools">sort by <select class="mlxc-p-sortby">${SORTS.map(([v, l]) => `<option value="${v}">${l}</option>`).join('')}</select>
        <button class="mlxc-p-dir-toggle" title="descending / ascending">▼</button></div>
      <div class="mlxc-p-files"></div>`;
    this.body = this.node.querySelector('.mlxc-p-body') as HTMLElement;
    this.status = this.node.querySelector('.mlxc-p-status') as HTMLElement;
    this.filter = this.node.querySelector('.mlxc-p-filter') as HTMLInputElement;
    this.pinnedSelect = this.node.querySelector('.mlxc-p-pinned') as HTMLSelectElement;
    let typing: number | undefined;
    this.filter.addEventListener('input', () => {
      window.clearTimeout(typing);
      typing = window.setTimeout(() => this.setPage({ query: this.filter.value, offset: 0 }), 250);
    });
    this.pinnedSelect.addEventListener('change', () => this.setPage({ pinned: this.pinnedSelect.value, offset: 0 }));
    const sortBy = this.node.querySelector('.mlxc-p-sortby') as HTMLSelectElement;
    sortBy.addEventListener('change', () => this.setPage({ sort: sortBy.value, descending: true, offset: 0 }));
    this.node.addEventListener('click', e => this.onClick(e));
  }

  // --- live updates: only while visible ---

  protected onAfterShow(msg: Message): void {
    void this.refresh();
    this.schedule();
  }

  protected onAfterHide(msg: Message): void {
    this.stop();
  }

  protected onBeforeDetach(msg: Message): void {
    this.stop();
  }

  private stop(): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
      this.timer = null;
    }
  }

  private schedule(ms = REFRESH_MS): void {
    this.stop();
    if (this.isVisible) {
      this.timer = window.setTimeout(async () => {
        this.timer = null;
        await this.refresh();
        this.schedule(this.last?.state === 'busy' ? (this.last.retry_s ?? 1) * 1000 : REFRESH_MS);
      }, ms);
    }
  }

  async refresh(): Promise<void> {
    if (this.inFlight || !this.isVisible) {
      return;
    }
    this.inFlight = true;
    this.requests++;
    this.node.dataset.requests = String(this.requests);
    try {
      const o = await fetchOverview(this.query);
      const shown = this.last;
      this.last = o;
      if (o.state === 'busy' && shown?.processes) {
        this.renderState(o); // keep what was shown: the badge says busy, and it asks again soon
      } else {
        this.render(o);
      }
    } finally {
      this.inFlight = false;
    }
  }

  private setPage(change: Partial<PageQuery>): void {
    Object.assign(this.query, change);
    void this.refresh();
  }

  // --- drawing ---

  private renderState(o: Overview): void {
    const state = this.node.querySelector('.mlxc-p-state') as HTMLElement;
    state.dataset.state = o.state;
    state.className = `mlxc-p-state mlxc-p-state-${o.state}`;
    state.textContent = STATES[o.state] ?? o.state;
    state.title = o.message ?? '';
    this.node.dataset.state = o.state;
  }

  private render(o: Overview): void {
    this.renderState(o);
    const now = o.time ?? Date.now() / 1000;
    const notes = [o.message, ...(o.warnings ?? [])].filter(Boolean).map(m => `<div class="mlxc-p-note">${esc(m)}</div>`);
    let html = `<div class="mlxc-p-dir" title="the cache directory">${esc(o.cache_dir ?? '')}</div>${notes.join('')}`;
    if (o.processes) {
      html += this.renderSsd(o) + this.renderProcesses(o, now);
    }
    if (o.models) {
      html += this.renderModels(o.models);
    }
    this.body.innerHTML = html;
    this.node.querySelectorAll('.mlxc-p-tools').forEach(t => ((t as HTMLElement).style.display = o.page ? '' : 'none'));
    const files = this.node.querySelector('.mlxc-p-files') as HTMLElement;
    (this.node.querySelector('.mlxc-p-dir-toggle') as HTMLElement).textContent = this.query.descending ? '▼' : '▲';
    files.innerHTML = o.page ? this.renderFiles(o, now) : '';
  }

  private pidLabel(o: Overview, pid: number | null | undefined): string {
    const k = pid ? o.kernels?.[String(pid)] : undefined;
    const where = k?.path ? ` · ${esc(k.path)}` : '';
    return `pid ${esc(pid ?? '?')}${where}`;
  }

  private renderSsd(o: Overview): string {
    const s = o.ssd!;
    const caps = s.caps && s.caps.length ? s.caps.map(bytes).join(' / ') : 'no cap';
    const total = s.bytes ?? 0;
    const scale = Math.max(total, ...(s.caps ?? [0]), 1);
    const writers = (o.processes ?? []).filter(p => p.bytes > 0);
    const referenced = writers.reduce((a, p) => a + p.bytes, 0) || 1;
    const spans = writers.map((p, i) => {
      const width = (100 * total / scale) * (p.bytes / referenced);
      return `<span class="mlxc-p-seg mlxc-p-seg-${i % 6}${p.alive ? '' : ' mlxc-p-dead'}" data-pid="${esc(p.pid)}"
        style="width:${width.toFixed(2)}%" title="${this.pidLabel(o, p.pid)}: ${esc(p.files)} checkpoints, ${esc(bytes(p.bytes))}"></span>`;
    });
    const legend = writers.map((p, i) => `<span class="mlxc-p-key"><i class="mlxc-p-seg-${i % 6}"></i>${this.pidLabel(o, p.pid)}${p.alive ? '' : ' (gone)'}: ${esc(bytes(p.bytes))}</span>`);
    const q = s.quarantine_files ? ` · quarantine: ${s.quarantine_files} files (${bytes(s.quarantine_bytes)})` : '';
    const aside = s.set_aside_catalogues.length ? ` · ${s.set_aside_catalogues.length} damaged catalogue(s) kept as evidence` : '';
    return `<div class="mlxc-p-h">SSD</div>
      <div class="mlxc-p-ssd" data-bytes="${esc(total)}">${esc(bytes(total))} unique on SSD · ${esc(caps)} · ${esc(s.files ?? 0)} checkpoints · ${esc(s.blocks ?? 0)} blocks${esc(q)}${esc(aside)}</div>
      <div class="mlxc-p-bar" title="SSD use per kernel (its checkpoints' bytes; shared blocks divided by use)">${spans.join('')}</div>
      <div class="mlxc-p-legend">${legend.join(' ')}</div>`;
  }

  private renderProcesses(o: Overview, now: number): string {
    const cards = (o.processes ?? []).map((p: ProcessRow) => {
      const r = p.report;
      const ram = r ? `RAM ${bytes(r.ram.used_bytes)} · ${r.ram.entries} entries` : 'RAM –';
      const writes = [
        p.pending_writes ? `${p.pending_writes} writes queued (${bytes(p.pending_bytes)})` : '',
        p.writing ? `${p.writing} writing` : '',
        r && r.writes.dirty ? `${r.writes.dirty} not on SSD yet` : '',
        r && r.writes.failed ? `${r.writes.failed} writes failed` : ''
      ].filter(Boolean).join(', ');
      const remote = r?.remote ? `remote ${r.remote.state}${r.remote.last_error ? ': ' + short(r.remote.last_error, 40) : ''}` : '';
      const dead = p.alive ? '' : (p.writing ? ` · died mid-write (${p.writing} unfinished)` : ' · gone');
      const models = r ? r.models.map(m => m.name).join(', ') : '';
      const lines = [
        `${ram}${models ? ' · ' + models : ''}`,
        `wrote ${p.files} checkpoints (${bytes(p.bytes)})${writes ? ' · ' + writes : ''}${remote ? ' · ' + remote : ''}`,
        `${p.host ?? ''} · started ${since(p.started, now)} · heartbeat ${ago(p.heartbeat_age_s)}`
      ];
      return `<div class="mlxc-p-card mlxc-p-proc${p.alive ? '' : ' mlxc-p-dead'}" data-pid="${esc(p.pid)}" data-alive="${p.alive}" data-owner="${esc(p.owner)}">
        <div><b>${p.alive ? '●' : '○'} ${this.pidLabel(o, p.pid)}</b>${esc(dead)}</div>
        ${lines.map(l => `<div class="mlxc-p-sub">${esc(l)}</div>`).join('')}</div>`;
    });
    return `<div class="mlxc-p-h">Kernels and other processes (${cards.length})</div>${cards.join('') || '<div class="mlxc-p-sub">none</div>'}`;
  }

  private renderModels(models: ModelGroup[]): string {
    if (this.query.group === null && models.length) {
      this.query.group = models[0].group; // the most recently used: asked for at the next refresh
      window.setTimeout(() => void this.refresh(), 0);
    }
    const items = models.map(m => {
      const label = m.kind === 'object' ? 'objects (@memo, images)' : (m.names.join(', ') || 'a model no live kernel has loaded');
      const on = m.group === this.query.group ? ' mlxc-p-on' : '';
      return `<button class="mlxc-p-group${on}" data-group="${esc(m.group)}" title="${esc(m.group)}">${esc(label)}
        <span class="mlxc-p-sub">${esc(m.files)} checkpoints · ${esc(bytes(m.bytes))} · ${esc(m.pinned)} pinned</span></button>`;
    });
    return `<div class="mlxc-p-h">Models</div><div class="mlxc-p-groups">${items.join('') || 'no checkpoints on SSD'}</div>`;
  }

  private renderFiles(o: Overview, now: number): string {
    const page = o.page!;
    const cards = page.files.map(f => this.renderFile(o, f, now)).join('');
    const end = Math.min(page.offset + page.files.length, page.matching);
    const more = `<div class="mlxc-p-pages">${page.offset + (page.files.length ? 1 : 0)}–${end} of ${page.matching}
      ${page.offset > 0 ? '<button data-page="-1">previous</button>' : ''}
      ${end < page.matching ? '<button data-page="1">next</button>' : ''}</div>`;
    return `${cards || '<div class="mlxc-p-sub">no checkpoint matches</div>'}${more}`;
  }

  private renderFile(o: Overview, f: FileRow, now: number): string {
    const where = ['SSD', ...f.in_ram.map(r => `RAM of pid ${r.pid}`)].join(' + ');
    const writer = f.writer ? `${this.pidLabel(o, f.writer.pid)}${f.writer.alive ? '' : ' (gone)'}` : 'an unknown process';
    const what = f.preview ? esc(short(f.preview, 80)) : `<code>${esc(f.key.slice(0, 16))}</code>`;
    const named = new Map(f.names.map(n => [n.name, n]));
    const pins = f.pinned_by.map(name => {
      const held = named.get(name)?.held_by;
      const unpin = held ? `<span class="mlxc-p-sub" title="saved or restored by a live kernel: %checkpoint rm there">(kernel pid ${esc(held)}'s)</span>`
        : `<button data-action="unpin" data-name="${esc(name)}" title="remove this name (the checkpoint stays)">unpin</button>`;
      return `<span class="mlxc-p-pin"><span class="mlxc-p-tag">pinned</span> ${esc(name)} ${unpin}</span>`;
    }).join(' ');
    const restore = f.pinned_by.map(name => `<button data-action="restore" data-name="${esc(name)}"
      title="restore '${esc(name)}' into the current notebook's kernel">restore ${esc(name)} here</button>`).join(' ');
    const extra = [f.kind === 'object' ? 'object' : '', f.leases ? `being read (${f.leases})` : '',
      f.sessions.length ? `sessions ${f.sessions.join(', ')}` : ''].filter(Boolean).join(' · ');
    return `<div class="mlxc-p-card mlxc-p-file" data-key="${esc(f.key)}" data-namespace="${esc(f.namespace)}" data-pinned="${f.pinned_by.length > 0}" data-in-ram="${f.in_ram.length > 0}">
      <div title="${esc(f.key)}">${what}</div>
      <div class="mlxc-p-sub">${esc(f.tokens)} tokens · ${esc(bytes(f.bytes))} · ${esc(where)} · used ${esc(since(f.last_used, now))}${extra ? ' · ' + esc(extra) : ''}</div>
      <div class="mlxc-p-sub">written by ${writer}</div>
      ${pins ? `<div>${pins}</div>` : ''}
      <div class="mlxc-p-actions"><button data-action="pin" title="keep it: a named checkpoint no cap or clear deletes">pin</button>
        <button data-action="delete" title="delete it from SSD (refused while pinned, read, or in a kernel's RAM)">delete</button> ${restore}</div></div>`;
  }

  // --- actions ---

  private say(answer: Answer): void {
    this.status.textContent = answer.message;
    this.status.dataset.ok = String(answer.ok);
    this.status.className = `mlxc-p-status ${answer.ok ? 'mlxc-p-good' : 'mlxc-p-bad'}`;
  }

  private async onClick(e: MouseEvent): Promise<void> {
    const t = e.target as HTMLElement;
    if (t.closest('.mlxc-p-refresh')) {
      return this.refresh();
    }
    const group = t.closest('.mlxc-p-group') as HTMLElement | null;
    if (group) {
      return this.setPage({ group: group.dataset.group ?? null, offset: 0 });
    }
    if (t.closest('.mlxc-p-dir-toggle')) {
      return this.setPage({ descending: !this.query.descending, offset: 0 });
    }
    const pageButton = t.closest('[data-page]') as HTMLElement | null;
    if (pageButton) {
      const step = Number(pageButton.dataset.page) * this.query.limit;
      return this.setPage({ offset: Math.max(0, this.query.offset + step) });
    }
    const button = t.closest('button[data-action]') as HTMLButtonElement | null;
    const row = t.closest('.mlxc-p-file') as HTMLElement | null;
    if (!button || !row) {
      return;
    }
    const key = row.dataset.key!;
    const namespace = row.dataset.namespace!;
    const name = button.dataset.name ?? '';
    button.disabled = true;
    try {
      const answer = await this.perform(button.dataset.action!, namespace, key, name);
      if (answer) {
        this.say(answer);
      }
    } finally {
      button.disabled = false;
      await this.refresh();
    }
  }

  private async perform(action: string, namespace: string, key: string, name: string): Promise<Answer | null> {
    if (action === 'pin') {
      const got = await InputDialog.getText({ title: 'Pin this checkpoint under a name', text: `pin-${key.slice(0, 8)}`, okLabel: 'Pin' });
      if (!got.button.accept || got.value === null) {
        return null;
      }
      if (!validName(got.value)) {
        return { ok: false, message: `invalid name ${JSON.stringify(got.value)}: 1-64 letters, digits, '_', '.' or '-'` };
      }
      return act('pin', { namespace, key, name: got.value });
    }
    if (action === 'unpin') {
      return act('unpin', { name });
    }
    if (action === 'delete') {
      const sure = await showDialog({ title: 'Delete this checkpoint from SSD?', body: 'Every kernel loses it; a rerun prefills it again.',
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Delete' })] });
      return sure.button.accept ? act('delete', { namespace, key }) : null;
    }
    if (action === 'restore') {
      const notebook = this.tracker.currentWidget;
      const kernel = notebook?.sessionContext.session?.kernel;
      if (!notebook || !kernel) {
        return { ok: false, message: 'open a notebook on the MLX Cache kernel first: the restore runs in its kernel' };
      }
      this.say({ ok: true, message: `asking the kernel of ${notebook.context.path} to restore ${name} …` });
      const answer = await restoreInKernel(kernel, name);
      return { ...answer, message: `${notebook.context.path}: ${answer.message}` };
    }
    return null;
  }
}
