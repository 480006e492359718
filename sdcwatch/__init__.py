"""What both programs share: the training-side library and the node agent.

Small, torch-free modules of values and names (states and severities, socket discovery, ...). This
package imports nothing of sdcwatch's other packages except the generated `proto` stubs, so either
side can import it without pulling in the other (see docs/architecture.md, "Two import sets").
"""

__version__ = "0.1.0"
