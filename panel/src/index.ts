// The "MLX Cache" JupyterLab side panel (see panel.ts); the server side is mlxcache_kernel/panel/.

import { ILabShell, ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { LabIcon } from '@jupyterlab/ui-components';

import { CachePanel } from './panel';

const ICON = new LabIcon({
  name: 'mlxcache-panel:icon',
  svgstr: `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" fill="#616161">
    <rect x="3" y="4" width="18" height="4" rx="1"/><rect x="3" y="10" width="18" height="4" rx="1"/>
    <rect x="3" y="16" width="11" height="4" rx="1"/></g></svg>`
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'mlxcache-panel:plugin',
  description: "A side panel over the MLX Cache directory: every kernel's checkpoints, pins and SSD use",
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, ILayoutRestorer, ICommandPalette],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker, shell: ILabShell | null,
    restorer: ILayoutRestorer | null, palette: ICommandPalette | null) => {
    const panel = new CachePanel(tracker);
    panel.title.icon = ICON;
    panel.title.label = shell ? '' : 'MLX Cache';
    app.shell.add(panel, 'left', { rank: 650 });
    restorer?.add(panel, 'mlxcache-panel');
    app.commands.addCommand('mlxcache:open-panel', {
      label: 'Show the MLX Cache panel',
      execute: () => app.shell.activateById(panel.id)
    });
    palette?.addItem({ command: 'mlxcache:open-panel', category: 'MLX Cache' });
  }
};

export default plugin;
