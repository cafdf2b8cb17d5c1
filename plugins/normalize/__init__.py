"""The `normalize` plugin (plugin) and its helpers: dynamic-value detectors, the template
learner, and suffix reuse for prompts that extend a recent one."""
