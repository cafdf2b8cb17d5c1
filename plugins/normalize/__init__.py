"""The `normalize` plugin (plugin) and its helpers: dynamic-value detectors, their label
vocabulary (labels), what a prompt only mentions (mentions), the template learner, and
suffix reuse for prompts that extend a recent one."""
