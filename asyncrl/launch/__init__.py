"""Starting a run and keeping it alive: launchers, supervision, process trees, progress.

Owns how roles are started, watched, restarted and stopped, on one machine or on a Ray
cluster, and what the user sees meanwhile:

- :mod:`~asyncrl.launch.local`: ``asyncrl-launch CONFIG``, every role on this machine
  (``python -m asyncrl.launch`` runs it too); the role plan and command lines both
  launchers share are in :mod:`~asyncrl.launch.roles`;
- :mod:`~asyncrl.launch.ray_launcher`, :mod:`~asyncrl.launch.ray_main`,
  :mod:`~asyncrl.launch.ray_plan`, :mod:`~asyncrl.launch.ray_handles`,
  :mod:`~asyncrl.launch.ray_copies`, :mod:`~asyncrl.launch.ray_agent`: ``asyncrl-launch
  --ray``, the same roles on Ray nodes;
- :mod:`~asyncrl.launch.supervise`: the supervisor loop both launchers drive (what happens
  when a role dies) over :mod:`~asyncrl.launch.role_state`, with its rules in
  :mod:`~asyncrl.launch.restart_policy`;
- :mod:`~asyncrl.launch.process_tree`: finding and killing a role's whole process tree,
  and the watchdog that clears the run if the launcher itself is killed;
- :mod:`~asyncrl.launch.departures`: telling the coordinator at once that a reaped server
  left (``Leave``);
- :mod:`~asyncrl.launch.progress`: the live line, the end-of-run summary and plots;
- :mod:`~asyncrl.launch.startup`: the start-up timeline every role writes and the
  launcher reads.

May import :mod:`asyncrl.config`, :mod:`asyncrl.net`, :mod:`asyncrl.control` (messages
only), :mod:`asyncrl.metrics` and :mod:`asyncrl.sandbox` (the process table); never a role
package (``learner``, ``buffer``, ``rollout_servers``), and no torch or vLLM: the launcher
stays a light process.
"""
