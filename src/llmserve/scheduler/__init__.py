from llmserve.scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from llmserve.scheduler.scheduler import Scheduler

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "SchedulerStats"]
