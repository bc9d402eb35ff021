//! `dispatch`: the dispatcher alone, draining a stored backlog into a no-op sink.

use super::{LoadFlags, json, load, print_rates, show_spread, spread, write_json};

pub(super) async fn dispatch(
    flags: &LoadFlags,
    events: u64,
    in_flight: usize,
) -> anyhow::Result<()> {
    let (rounds, rss) = load::dispatch(&flags.load_args(), events, in_flight).await?;
    println!(
        "dispatch: {events} stored events of {} B, maxInFlightMessages {in_flight}, {} rounds",
        flags.size,
        rounds.len()
    );
    let mut to_min = Vec::new();
    let mut to_both = Vec::new();
    let mut to_cpu = Vec::new();
    for (index, round) in rounds.iter().enumerate() {
        print_rates(
            &format!("round {}", index + 1),
            &[&round.dispatcher, &round.ack_only, &round.http_only],
        );
        let limit = round.ack_only.per_second.min(round.http_only.per_second);
        let both = round.both_in_series();
        println!("both raw halves in series: {both:.0} events/s");
        for (phase, cpu) in ["dispatcher", "ack only", "HTTP only"]
            .iter()
            .zip(round.machine_cpu)
        {
            println!(
                "machine CPU per event, {phase}: {:.1} µs ({:.2} cores busy), of it dispatcher \
                 {:.1}, nats-server {:.1}, bench and sink {:.1}",
                cpu.us_per_op, cpu.cores_busy, cpu.eddy_us, cpu.nats_us, cpu.bench_us
            );
        }
        let cpu_to_halves = round.cpu_to_halves();
        println!("dispatcher / the two halves added: {cpu_to_halves:.2}");
        to_min.push(round.dispatcher.per_second / limit.max(1e-9));
        to_both.push(round.dispatcher.per_second / both.max(1e-9));
        to_cpu.push(cpu_to_halves);
    }
    let (to_min, to_both, to_cpu) = (spread(&to_min), spread(&to_both), spread(&to_cpu));
    println!("dispatcher / lower raw half: {}", show_spread(&to_min));
    println!(
        "dispatcher / both raw halves in series: {}",
        show_spread(&to_both)
    );
    println!(
        "machine CPU per event, dispatcher / the two halves added: {}",
        show_spread(&to_cpu)
    );
    println!("dispatcher peak RSS: {rss:.1} MiB");
    write_json(
        flags.out.as_ref(),
        &json!({"scenario": "dispatch", "events": events, "inFlight": in_flight, "rounds": rounds,
            "dispatcherToLowerHalf": to_min, "dispatcherToBothInSeries": to_both,
            "machineCpuDispatcherToHalves": to_cpu,
            "dispatcherPeakRssMiB": rss}),
    )
}
