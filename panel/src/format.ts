// Formatting shared by the panel's tables (as widgets/format.py does for the kernel's views).

export function esc(value: unknown): string {
  return String(value ?? '').replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
}

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined) {
    return '–';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

export function ago(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined) {
    return '–';
  }
  if (seconds < 1) {
    return 'now';
  }
  if (seconds < 120) {
    return `${Math.round(seconds)} s ago`;
  }
  if (seconds < 7200) {
    return `${Math.round(seconds / 60)} min ago`;
  }
  if (seconds < 172800) {
    return `${Math.round(seconds / 3600)} h ago`;
  }
  return `${Math.round(seconds / 86400)} days ago`;
}

export function since(epoch: number | null | undefined, now: number): string {
  return epoch ? ago(now - epoch) : '–';
}

export function short(text: string | null | undefined, n = 60): string {
  const t = (text ?? '').replace(/\s+/g, ' ').trim();
  return t.length > n ? t.slice(0, n - 1) + '…' : t;
}
