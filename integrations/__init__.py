"""sdcwatch inside training frameworks: the README's loop (Monitor, replica recovery, checkpoints through the
agent, the agent's directives) driven by a framework's own hooks.

- `integrations.session.TrainingSession`: the framework-free core every adapter drives;
- `integrations.hf.SdcwatchCallback`: a Hugging Face `transformers.TrainerCallback` (`sdcwatch[hf]`);
- `integrations.lightning.SdcwatchCallback`: a Lightning `Callback` (`sdcwatch[lightning]`);
- `integrations.torchtitan`: a torchtitan checkpoint component its trainer config names
  (`sdcwatch[torchtitan]`).

Import the modules by name; this `__init__` imports nothing, so importing one framework's adapter never
loads another framework. Training side: never imports the agent (`daemon`).
"""
